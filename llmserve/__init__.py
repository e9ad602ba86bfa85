"""llmserve: an LLM inference server with a token-level KV cache and Triton kernels."""

from llmserve.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # Lazy: `import llmserve` stays cheap for worker processes and the CLI's --help.
    if name in ("LLM", "RequestOutput"):
        from llmserve import llm

        return getattr(llm, name)
    raise AttributeError(name)
