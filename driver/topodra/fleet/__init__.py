"""The fleet model: which GPUs exist, which are unavailable, what claims ask for, how fragmented it is.

One neutral, pure model shared by the three programs that reason about free GPUs: the placement
scorer (``placement``), the inventory (``clusterview``) and the controller's availability report
(``controller/availability.py``). A device is *unavailable* when it is allocated (in some claim's
``status.allocation``) or carries a blocking taint (NoSchedule or NoExecute, in its slice or from a
DeviceTaintRule); see ``taints``. Keeping this in one place is what makes the F_n the inventory prints
the number the scorer optimises.

``pools`` picks the newest slices, ``allocations`` who holds what, ``taints`` device taints and
DeviceTaintRules, ``nodes`` node schedulability, ``cel`` the CEL subset, ``demand`` claim specs,
``state`` the per-node device views the scorer and the inventory read, ``allocator`` the emulation of
the scheduler's allocator, ``fgd`` the request mix and the fragmentation measure F_n.
"""
