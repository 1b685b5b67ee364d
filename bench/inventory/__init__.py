"""bench/run inventory: topodra inventory timed as an operator runs it, on the simulated enterprise-400."""
