import pytest

from llmserve.chat_template import CHAT_TEMPLATES, BaseTemplate
from llmserve.chat_template.registry import Registry, UnknownNameError


def test_register_get_and_aliases():
    reg = Registry("widget")

    @reg.register_module(name="b")
    @reg.register_module(name="a")
    class Widget:
        pass

    assert reg.get("a") is Widget and reg.get("b") is Widget
    assert reg.names() == ["a", "b"] and "a" in reg and "c" not in reg and len(reg) == 2


def test_unknown_name_lists_the_known_ones():
    reg = Registry("widget")
    reg.register_module(name="one")(type("One", (), {}))
    reg.register_module(name="two")(type("Two", (), {}))
    with pytest.raises(UnknownNameError) as e:
        reg.get("three")
    assert str(e.value) == "unknown widget 'three'; known: one, two"
    assert isinstance(e.value, KeyError)


def test_a_name_is_registered_once():
    reg = Registry("widget")
    reg.register_module(name="x")(type("X", (), {}))
    with pytest.raises(ValueError, match="already registered"):
        reg.register_module(name="x")(type("Y", (), {}))


def test_default_name_is_the_class_name():
    reg = Registry("widget")

    @reg.register_module()
    class Gadget:
        pass

    assert reg.get("Gadget") is Gadget


def test_builtin_names():
    assert set(CHAT_TEMPLATES.names()) >= {
        "internlm-7b", "internlm-20b", "internlm-chat-7b", "internlm-chat-7b-8k", "internlm-chat-20b",
        "llama2", "llama3", "chatml", "qwen", "mistral", "vicuna", "llava"}
    assert CHAT_TEMPLATES.get("internlm-7b") is BaseTemplate       # the seed registers the base class itself
    assert CHAT_TEMPLATES.get("qwen") is CHAT_TEMPLATES.get("chatml")
    assert CHAT_TEMPLATES.get("internlm-chat-20b") is CHAT_TEMPLATES.get("internlm-chat-7b-8k")
