"""`loomserve bench`: a load generator for any OpenAI-compatible server.

command (click) → session (one invocation) → runner (one run: schedule, concurrency, duration)
→ client (one streamed request, timed) → records → metrics (pure) → report (table, JSON, PNG).
"""
