"""`ftrun status`: the live health of a running job, or the summary of one that ended."""
