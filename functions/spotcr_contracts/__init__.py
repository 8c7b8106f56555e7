"""Contracts shared by the cloud side (functions/, infra/) and the VM side (vm-bootstrap/).

Standard library only: this package is shipped to job VMs beside the agent.
"""
