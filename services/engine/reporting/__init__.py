"""What an engine reports: NATS load and lifecycle events, expert loads for the EPLB planner, request and step
observations."""
