"""The benchmarks: one folder per question, one entry point (``bench/run NAME`` or ``python -m bench NAME``).

bench/README.md maps each question to its bench, the doc section that quotes it and the result file.
"""
