"""Token in, token out: the ids a turn adds to a trajectory, so the trainer scores exactly what the sampler saw.

A trajectory is the prompt's ids, then per turn the model's sampled ids as they came out of the sampler (never
re-tokenized from text) and the ids of what answered it (tool results, environment messages), ending with the opening
of the model's next turn. Those observation ids are what the chat template renders for the new messages after a
finished assistant turn: rendered once after a fixed two-message conversation and once without them, and the
difference taken. Texts are tokenized as prompts are (tasks/data/formatting.py: the template's text, no special tokens
added). The template's glue after the model's end-of-turn token (ChatML's newline after `<|im_end|>`) belongs to the
observation, so a trajectory reads as the template would write the whole conversation.

A model without a chat template (a base model, or `prompt.chat_template: never`) reads plain text: the prompt is its
messages' contents tokenized as a prompt is (special tokens added), an observation its messages' contents tokenized
without them, right after the model's end-of-turn token.
"""

from __future__ import annotations

from schemas.errors import UserError

# A finished exchange to render new messages after: its content does not matter, only that it ends an assistant turn.
_BEFORE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]


class TemplateError(UserError, ValueError):
    pass


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, add_generation_prompt=generation_prompt, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def observation_ids(
    tokenizer, new_messages: list[dict], tools: list[dict] | None = None, chat: bool = True
) -> list[int]:
    """The ids that follow the model's end-of-turn token when `new_messages` answer it and the model speaks next."""
    if not chat:
        return list(tokenizer("".join(m["content"] for m in new_messages), add_special_tokens=False)["input_ids"])
    before = render_ids(tokenizer, _BEFORE, tools, generation_prompt=False)
    after = render_ids(tokenizer, _BEFORE + new_messages, tools, generation_prompt=True)
    if after[: len(before)] != before:
        raise TemplateError(
            "the chat template renders a finished conversation differently once more messages follow it, so turns "
            "cannot be appended token by token (a template that rewrites earlier turns, e.g. one that drops past "
            "reasoning)"
        )
    eos = tokenizer.eos_token_id
    glue = before[len(before) - before[::-1].index(eos) :] if eos in before else []
    return glue + after[len(before) :]


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None, chat: bool = True) -> list[int]:
    """The opening of a trajectory: the first messages and the model's turn opened."""
    if not chat:
        return list(tokenizer("".join(m["content"] for m in messages))["input_ids"])
    return render_ids(tokenizer, messages, tools, generation_prompt=True)
