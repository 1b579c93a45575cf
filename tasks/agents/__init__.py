"""Building blocks of multi-turn, tool-using rollouts: the user's tools (tools.py), the model's tool calls parsed in
its template's format (tool_calls.py), environments (environments.py) and the token ids each turn adds
(turn_tokens.py). Pure code: the rollout stage drives them."""
