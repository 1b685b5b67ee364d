"""bench/run cel_engines: the scorer's CEL evaluator against CEL libraries (bench/README.md)."""
