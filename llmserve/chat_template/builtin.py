"""The built-in chat templates.

The InternLM ones carry the seed document's strings and defaults. The others follow the format
their model card documents (quoted beside each, without the leading BOS, which the tokenizer
adds); their sampling defaults are the model's generation_config where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from llmserve.chat_template.base import BaseTemplate, RoleTemplate
from llmserve.chat_template.registry import Registry
from llmserve.chat_template.tools import HermesTools, Llama3JsonTools, MistralTools, ToolFormat

CHAT_TEMPLATES = Registry("chat template")


def stop_words(*words: str):
    return field(default_factory=lambda: list(words))


# -- InternLM (the seed) -----------------------------------------------------------------

# A base model only continues text; its defaults are BaseTemplate's own.
CHAT_TEMPLATES.register_module(name="internlm-7b")(BaseTemplate)


@CHAT_TEMPLATES.register_module(name="internlm-20b")
@dataclass
class InternLM20B(BaseTemplate):
    """Generation parameters of InternLM-20B-Base model."""
    session_len: int = 4096
    capability: str = "completion"


INTERNLM_META_INSTRUCTION = """You are an AI assistant whose name is InternLM (书生·浦语).
- InternLM (书生·浦语) is a conversational language model that is developed by Shanghai AI Laboratory (上海人工智能实验室). It is designed to be helpful, honest, and harmless.
- InternLM (书生·浦语) can understand and communicate fluently in the language chosen by the user such as English and 中文.
"""  # noqa: E501


@CHAT_TEMPLATES.register_module(name="internlm-chat-7b")
@dataclass
class InternLMChat7B(RoleTemplate):
    """<|System|>:{meta}\\n<|User|>:{U1}\\n<|Bot|>:{A1}<eoa>\\n<|User|>:{U2}\\n<|Bot|>:"""
    system: str = "<|System|>:"
    meta_instruction: str | None = INTERNLM_META_INSTRUCTION
    user: str = "<|User|>:"
    eoh: str = "\n"
    eosys: str = "\n"
    assistant: str = "<|Bot|>:"
    eoa: str = "<eoa>"
    separator: str = "\n"          # a later turn starts on a new line after the answer's <eoa>
    stop_words: list[str] | None = stop_words("<eoa>")


@CHAT_TEMPLATES.register_module(name="internlm-chat-20b")
@CHAT_TEMPLATES.register_module(name="internlm-chat-7b-8k")
@dataclass
class InternLMChat7B8K(InternLMChat7B):
    """Chat template and generation parameters of InternLM-Chat-7B-8K and InternLM-Chat-20B models."""
    session_len: int = 8192


# -- chat formats from model cards -------------------------------------------------------

@CHAT_TEMPLATES.register_module(name="llama2")
@dataclass
class Llama2(RoleTemplate):
    """Llama-2-chat: ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{U1} [/INST] {A1} </s><s>[INST] {U2} [/INST]``"""
    system: str = "<<SYS>>\n"
    eosys: str = "\n<</SYS>>\n\n"
    system_in_first_user: bool = True
    user: str = "[INST] "
    eoh: str = " [/INST]"
    answer_lead: str = " "
    eoa: str = " </s>"
    separator: str = "<s>"          # every turn after the first opens with its own BOS
    session_len: int = 4096
    temperature: float = 0.6
    top_p: float = 0.9


@CHAT_TEMPLATES.register_module(name="llama3")
@dataclass
class Llama3(RoleTemplate):
    """Llama 3 Instruct: ``<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{U1}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n``"""
    system: str = "<|start_header_id|>system<|end_header_id|>\n\n"
    eosys: str = "<|eot_id|>"
    user: str = "<|start_header_id|>user<|end_header_id|>\n\n"
    eoh: str = "<|eot_id|>"
    assistant: str = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    eoa: str = "<|eot_id|>"
    stop_words: list[str] | None = stop_words("<|eot_id|>")
    session_len: int = 8192
    temperature: float = 0.6
    top_p: float = 0.9
    tool_format: ClassVar[ToolFormat | None] = Llama3JsonTools()


@CHAT_TEMPLATES.register_module(name="qwen")
@CHAT_TEMPLATES.register_module(name="chatml")
@dataclass
class ChatML(RoleTemplate):
    """ChatML, as Qwen's chat models use it: ``<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n
    <|im_start|>user\\n{U1}<|im_end|>\\n<|im_start|>assistant\\n{A1}<|im_end|>\\n<|im_start|>user\\n...``"""
    system: str = "<|im_start|>system\n"
    meta_instruction: str | None = "You are a helpful assistant."
    eosys: str = "<|im_end|>\n"
    user: str = "<|im_start|>user\n"
    eoh: str = "<|im_end|>\n"
    assistant: str = "<|im_start|>assistant\n"
    eoa: str = "<|im_end|>"
    separator: str = "\n"
    stop_words: list[str] | None = stop_words("<|im_end|>")
    session_len: int = 8192
    tool_format: ClassVar[ToolFormat | None] = HermesTools()


@CHAT_TEMPLATES.register_module(name="smollm")
@dataclass
class SmolLM(ChatML):
    """SmolLM2-Instruct: ChatML with its own default system message; temperature 0.2 and top_p 0.9
    are the model card's sampling example."""
    meta_instruction: str | None = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    temperature: float = 0.2
    top_p: float = 0.9


@CHAT_TEMPLATES.register_module(name="mistral")
@dataclass
class Mistral(RoleTemplate):
    """Mistral-7B-Instruct: ``<s>[INST] Instruction [/INST] Model answer</s>[INST] Follow-up instruction [/INST]``.
    It has no system role; a system message opens the first instruction, as its later tokenizers do."""
    eosys: str = "\n\n"
    system_in_first_user: bool = True
    user: str = "[INST] "
    eoh: str = " [/INST]"
    answer_lead: str = " "
    eoa: str = "</s>"
    session_len: int = 32768
    tool_format: ClassVar[ToolFormat | None] = MistralTools()


@CHAT_TEMPLATES.register_module(name="gemma")
@dataclass
class Gemma(RoleTemplate):
    """Gemma 1 / 2 / 3 instruction-tuned: ``<start_of_turn>user\n{U1}<end_of_turn>\n<start_of_turn>model\n
    {A1}<end_of_turn>\n<start_of_turn>user\n...``. It has no system role: a system message opens the
    first user turn, followed by a blank line (as Gemma 3's own template does; Gemma 2's refuses
    one). No tool-call format: Gemma's function calling is prompted, not a template format."""
    eosys: str = "\n\n"
    system_in_first_user: bool = True
    user: str = "<start_of_turn>user\n"
    eoh: str = "<end_of_turn>\n"
    assistant: str = "<start_of_turn>model\n"
    eoa: str = "<end_of_turn>"
    separator: str = "\n"
    stop_words: list[str] | None = stop_words("<end_of_turn>")
    session_len: int = 8192


VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")


@CHAT_TEMPLATES.register_module(name="vicuna")
@dataclass
class Vicuna(RoleTemplate):
    """Vicuna v1.1+ (FastChat's vicuna_v1.1): ``{system} USER: {U1} ASSISTANT: {A1}</s>USER: {U2} ASSISTANT:``"""
    meta_instruction: str | None = VICUNA_SYSTEM
    eosys: str = " "
    user: str = "USER: "
    eoh: str = " "
    assistant: str = "ASSISTANT:"
    answer_lead: str = " "
    eoa: str = "</s>"


@CHAT_TEMPLATES.register_module(name="llava")
@dataclass
class Llava(Vicuna):
    """LLaVA v1.5 (its conv_llava_v1 / vicuna_v1 conversation), Vicuna's format with its own system text:
    ``{system} USER: <image>\\n{U1} ASSISTANT:``: an image part renders as its placeholder and a newline."""
    image: str = "<image>\n"
    meta_instruction: str | None = ("A chat between a curious human and an artificial intelligence assistant. "
                                    "The assistant gives helpful, detailed, and polite answers to the human's questions.")
    session_len: int = 4096
