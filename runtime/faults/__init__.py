"""A failing rank never leaves the others hanging: failure records, timeouts on
collectives, the process group aborted with the failing rank named."""
