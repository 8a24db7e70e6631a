"""The policy as an OpenAI-compatible endpoint, and agent tasks trained through it (docs/agents.md, "Bring
your own agent").

``protocol`` reads requests, ``chat`` renders messages to token ids token-faithfully, ``batcher`` batches
concurrent requests into the engine, ``server`` serves the routes on 127.0.0.1, ``stream`` writes streamed
answers as server-sent events, ``capture`` turns an episode's calls into trajectories and ``rollout`` plays
agent episodes.
"""
