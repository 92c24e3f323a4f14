"""What the rewriters know about code before they change it: names and scopes,
and each statement's effects (reads, writes, liveness)."""
