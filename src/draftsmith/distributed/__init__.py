"""Ranks and process groups. `ranks` says which rank this process is without importing torch
(status, plan and the run directory's bookkeeping ask it); `group` sets up the process group of the
stages that run on several ranks and applies FSDP2 (docs/distributed.md)."""
