"""The ClaimProfile controller: profiles in, ResourceClaimTemplates and availability status out.

Pure parts (``profile``, ``render``, ``availability``) import nothing heavy;
``operator`` and ``main`` bring in kopf; ``leader`` is our own Lease loop.
All of our own API calls go through ``topodra.kube.Kube``, with paths from
``topodra.apipaths``; device predicates come from the neutral ``topodra.selectors``.
"""
