"""The OpenAI-compatible HTTP API: request bodies, their validation, the routes and the served OpenAPI description."""
