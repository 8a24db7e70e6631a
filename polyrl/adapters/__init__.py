"""Adapters that let agent code written for other frameworks train through polyrl's endpoint.

``agents_sdk``: OpenAI Agents SDK agents (``pip install 'polyrl[agents]'``). TextArena games are an env
(``env: textarena``, polyrl/envs/textarena_env.py). Each adapter imports its framework only when used.
"""
