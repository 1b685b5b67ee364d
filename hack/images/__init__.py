"""Building OCI images without Docker: ``mkoci`` (a rootfs into an OCI tarball) and ``topodra_image`` (the
runtime image). Installed by the dev setup as ``images`` (hack/pyproject.toml) so tests import them by name."""
