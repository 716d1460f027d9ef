"""OpenAI-compatible capture gateway: serves a policy, records main turns, hot-reloads weights."""
