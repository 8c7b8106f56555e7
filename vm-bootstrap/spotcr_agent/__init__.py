"""spotcr's VM agent: runs the job so CRIU can checkpoint it, takes and restores checkpoints."""
