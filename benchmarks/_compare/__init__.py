"""The parts of benchmarks/compare.py, which reads the command line, runs
them and writes the JSON and the plots:

  workload    the batches (Zipf users and items, labels from a hidden model)
              and the collaborative-filtering model that trains on them
  contenders  the eight table + optimizer set-ups compared, built from the
              same seed, and why one is skipped where it cannot fit
  running     the timing loop over each contender, the dense part alone,
              and the checks that the contenders agree before any timing
              is reported
  reporting   the printed table and notes, and the plots

benchmarks/ must be on sys.path (compare.py's own folder, where it runs):
these import _common by its bare name.
"""
