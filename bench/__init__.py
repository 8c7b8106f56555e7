"""spotcr benchmarks (`python -m bench`): figures printed and written to bench/results/, never timed tests."""
