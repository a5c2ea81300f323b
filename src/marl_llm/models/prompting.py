"""How a user message becomes prompt ids: `model.chat_template` and `model.chat_template_kwargs`.

The references prompt differently: the CoMLRL writing and code trainers tokenize the raw prompt
string (no chat template), the Minecraft (StrBuild) configs use the chat template, PettingLLMs
uses it with Qwen3's thinking mode off. A setting is checked against the tokenizer once, when the
model loads, and travels with the tokenizer (`tokenizer.prompt_format`) to every place that
encodes prompts (rollouts, the centralized critic's joint history, benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from marl_llm.config import UserError


@dataclass(frozen=True)
class PromptFormat:
    # True: the tokenizer's chat template with the assistant header; False: the raw text.
    use_template: bool
    # Extra template variables, e.g. {"enable_thinking": False}.
    template_kwargs: dict[str, Any] = field(default_factory=dict)


class Message(str):
    """A user message that also says how a reference sent it (a task's `paper` prompts): `system`,
    a system message placed before it in the chat template; `raw`, sent as plain text without the
    template even when the model's prompts are templated (StrBuild's reference templates only its
    first turn). Everywhere else (histories, logs, feedback) it is just its text."""

    system: str | None
    raw: bool

    def __new__(cls, text: str, system: str | None = None, raw: bool = False) -> "Message":
        obj = super().__new__(cls, text)
        obj.system, obj.raw = system, raw
        return obj

    def __reduce__(self):  # pickles (checkpointed samples, worker processes) keep the parts
        return Message, (str(self), self.system, self.raw)


def chat_messages(message: str) -> list[dict[str, str]]:
    """The chat-template messages of a user message (with its system message, if it has one)."""
    system = getattr(message, "system", None)
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": str(message)}]


def template_variables(template: str) -> set[str]:
    """The variables a Jinja chat template reads (its undeclared names)."""
    import jinja2
    from jinja2 import meta

    return set(meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def prompt_format(tokenizer, setting: Any, template_kwargs: dict[str, Any], model_name: str) -> PromptFormat:
    """The checked format for one tokenizer: `setting` is model.chat_template (auto | true | false)."""
    template = getattr(tokenizer, "chat_template", None)
    kwargs = dict(template_kwargs or {})
    if setting is True and not template:
        raise UserError(f"model.chat_template=true but the tokenizer of {model_name} has no chat template: "
                        "set model.chat_template=false (raw prompts) or auto")
    use = bool(template) if setting == "auto" else bool(setting)
    if kwargs:
        if not use:
            raise UserError(f"model.chat_template_kwargs {sorted(kwargs)} need a chat template, and {model_name} is "
                            "prompted raw: set model.chat_template=true or drop the options")
        unknown = sorted(set(kwargs) - template_variables(template))
        if unknown:
            raise UserError(f"model.chat_template_kwargs {unknown} are not read by the chat template of {model_name}: "
                            "drop them (e.g. enable_thinking exists only in thinking models' templates such as Qwen3)")
    return PromptFormat(use, kwargs)


def encode_prompt(tokenizer, message: str) -> list[int]:
    """A user message as prompt ids, in the tokenizer's checked `prompt_format` (unset: the chat
    template with the assistant header when the tokenizer has one, else the raw text). A `Message`
    adds its system message, or is sent raw when it says so."""
    fmt = getattr(tokenizer, "prompt_format", None) or PromptFormat(bool(getattr(tokenizer, "chat_template", None)))
    if fmt.use_template and not getattr(message, "raw", False):
        ids = tokenizer.apply_chat_template(chat_messages(message), add_generation_prompt=True,
                                            tokenize=True, return_dict=True, **fmt.template_kwargs)["input_ids"]
        return list(ids)
    return tokenizer(str(message), add_special_tokens=True)["input_ids"]
