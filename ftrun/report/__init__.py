"""`ftrun report`: a run's timeline (world size, step rate, loss, faults, each recovery's phases) as an SVG."""
