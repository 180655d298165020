"""EPLB: expert-parallel load balancing for the MoE layers.

``policy`` is DeepInfer's two-stage greedy policy, ``guarded`` the planner that never applies a worse
layout and moves few experts, ``simulate`` replays traces, ``cli`` is ``shinkai eplb``, and ``service``
is the NATS planner (``python -m services.entrypoints.eplb``). Heavy modules are imported where used.
"""
