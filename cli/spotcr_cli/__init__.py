"""spotcr: the user's command for jobs, checkpoints, interruptions and plans."""
