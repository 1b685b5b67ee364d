"""``topodra inventory``: a read-only view of what is free, where, and what can still be placed.

``model`` turns raw API objects into the view (pure), ``fetch`` lists those objects,
``table`` and ``picture`` render the view as text and as a PNG, ``exporter`` serves it
as Prometheus gauges, ``main`` is the CLI.  The fragmentation measure is the placement
scorer's (``topodra.placement.score``), not a second definition.
"""
