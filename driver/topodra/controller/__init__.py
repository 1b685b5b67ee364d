"""The ClaimProfile controller: profiles in, ResourceClaimTemplates and availability status out.

Pure parts (``profile``, ``render``, ``availability``, ``match``, ``leader``
decisions) import nothing heavy; ``operator`` and ``main`` bring in kopf.
"""
