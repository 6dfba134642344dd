"""LangChain's own standard test suites (``langchain-tests``) against ``ChatKVShelf``.

The integration suite runs the real embedded Gemma 3 270M, offline, with ``$HOME`` in a
temporary directory. Capabilities are declared as they are: tool calling with
``tool_choice``, JSON mode, structured output, usage metadata with cache reads; no images,
audio, PDFs or per-call model switching (kvshelf serves the one model it loaded).

Tool calls and JSON replies are constrained by grammars, so none fails for malformed
arguments or JSON; only the cases where the 270M model *chooses* a wrong value, wrong keys
or no call at all are marked xfail (strict), each with its reason. Replies are kept short
(``max_tokens``) so the suite runs in a few minutes on two CPU cores: a 270M model rarely
ends a free reply on its own (a constrained one ends where its grammar does).

The async tests run under pytest-asyncio through this module's ``pytestmark``, so this
file needs no ``asyncio_mode = "auto"`` and nothing changes for the rest of the suite.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from kvshelf.adapters.langchain import ChatKVShelf
from kvshelf.runtime.engine import Engine
from tests.support.langchain_env import offline_langchain_env

# Every test gets pytest-asyncio's marker, so the inherited ``async def`` tests run without
# ``asyncio_mode = "auto"`` (which would change the whole suite); sync tests ignore it.
pytestmark = [
    pytest.mark.embedded,
    pytest.mark.asyncio,
    pytest.mark.filterwarnings(
        "ignore:The test <Function .*is marked with '@pytest.mark.asyncio' but it is not an async"
    ),
]

_ENGINE: list[Engine] = []  # the integration suite's engine, for chat_model_params (a property, so no fixtures)


offline_home = pytest.fixture(scope="module", autouse=True)(offline_langchain_env)


@pytest.fixture(scope="module")
def standard_engine(embedded_loaded, tmp_path_factory) -> Iterator[Engine]:
    """One engine on the embedded model for the integration suite, caches in a temp directory."""
    eng = Engine(model=embedded_loaded, cache_dir=tmp_path_factory.mktemp("lc-standard"), progress=False)
    _ENGINE.append(eng)
    yield eng
    _ENGINE.clear()
    eng.close()


class TestChatKVShelfUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVShelf]:
        return ChatKVShelf

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "embedded"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"KVSHELF_API_KEY": "sk-test", "KVSHELF_BASE_URL": "http://127.0.0.1:1/v1"},
            {},
            {"api_key": "sk-test", "base_url": "http://127.0.0.1:1/v1"},
        )

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False


# Replies long enough for a whole JSON object (the joke schema) or tool call; 8 tokens otherwise.
_MAX_TOKENS = {
    "test_structured_output": 48,
    "test_structured_output_async": 48,
    "test_json_mode": 48,
    "test_structured_output_pydantic_2_v1": 48,
    "test_structured_output_optional_param": 48,
    "test_tool_calling": 16,
    "test_tool_calling_async": 16,
    "test_tool_choice": 16,
    "test_tool_calling_with_no_arguments": 12,
    "test_bind_runnables_as_tools": 20,
    "test_agent_loop": 20,
    # a right call (customer_name '你好啊集团' and a one-line description) is 40-45 tokens
    "test_unicode_tool_call_integration": 64,
}


@pytest.mark.usefixtures("standard_engine")
class TestChatKVShelfIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVShelf]:
        return ChatKVShelf

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": _ENGINE[0], "max_tokens": 8}

    @pytest.fixture
    def model(self, request: Any) -> ChatKVShelf:
        extra = getattr(request, "param", None) or {}
        max_tokens = _MAX_TOKENS.get(request.node.originalname, 8)
        return ChatKVShelf(**{**self.chat_model_params, "max_tokens": max_tokens, **extra})

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # one model per engine; a per-call ``model`` is accepted and ignored

    @property
    def supported_usage_metadata_details(
        self,
    ) -> dict[
        Literal["invoke", "stream"],
        list[Literal["audio_input", "audio_output", "reasoning_output", "cache_read_input", "cache_creation_input"]],
    ]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """The same agent asked twice: the second prompt is read from its cache."""
        llm = ChatKVShelf(**self.chat_model_params, agent_id="standard-cache-read")
        messages = [HumanMessage("Name three colours.")]
        llm.invoke(messages)
        if not stream:
            return llm.invoke(messages)
        full: Any = None
        for chunk in llm.stream(messages):
            full = chunk if full is None else full + chunk
        return full

    # -- what the 270M model chooses (each seen failing on the embedded model) ---------------------
    # Tool calls and JSON are constrained by a grammar (kvshelf.structured), so every call parses,
    # names an offered tool and has arguments that validate against its schema, and every JSON
    # reply validates: the cases that failed on malformed arguments or JSON now pass (tool_choice,
    # no-argument tools, runnables as tools, every structured-output variant). What is left is
    # what the model chooses to write within the grammar.
    @pytest.mark.xfail(
        reason="270M model's choice: the forced call is well-formed, but the model picks the value "
        "{'input': 100} for magic_function(3)",
        strict=True,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(
        reason="270M model's choice: a well-formed call with the value {'input': 100} for magic_function(3)",
        strict=True,
    )
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(
        reason="270M model's choice: json_object mode has no schema to enforce, and the model's valid "
        "JSON object uses keys of its own instead of 'setup' and 'punchline'",
        strict=True,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="270M model's choice: under tool_choice auto it answers in text and never opens a call",
        strict=True,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="270M model's choice: the call is well-formed and customer_name is right ('你好啊集团'), "
        "but for 'description' (a string with no maxLength) the model copies the tool's docstring and "
        "goes on writing lines of its own, past the 64 tokens given (finish_reason length: a cut call is "
        "never returned as a call)",
        strict=True,
    )
    def test_unicode_tool_call_integration(
        self, model: BaseChatModel, *, tool_choice: str | None = None, force_tool_call: bool = True
    ) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
