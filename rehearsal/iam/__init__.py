"""The local AWS's IAM: every call a spotcr principal makes is judged by its policies as AWS judges it."""
