"""``topodra inventory``: a read-only view of what is free, where, and what can still be placed.

``model`` turns raw API objects into the view (pure), ``fetch`` lists those objects,
``table`` and ``picture`` render the view as text and as a PNG, ``exporter`` serves it
as Prometheus gauges, ``main`` is the CLI.  What is unavailable and the fragmentation
measure come from the fleet model (``topodra.fleet``) the placement scorer uses, not a
second definition.
"""
