"""topodra's test kit: the real local cluster, the plugin as a host process, Kueue, kubelet stand-ins and
the fixtures' helpers. Installed by the dev setup (``make venv``) as its own distribution, so tests, bench
and hack import it by name; the runtime image never ships it (its wheel is built from driver/ only)."""
