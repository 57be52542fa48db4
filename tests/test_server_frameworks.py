"""The frameworks people build agents on, unchanged, against a real server: the OpenAI Agents SDK (the
Responses API), LangChain's ``ChatOpenAI`` (chat completions and the Responses API: ``bind_tools`` and
``with_structured_output``, whole and streamed) and Pydantic AI (a tool and a typed output, on both APIs).
Each asserts the mechanism: valid calls, the tool's result reaching the model, outputs that validate."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI, OpenAI

from conftest import Colour, Weather

QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def base_url(openai_frontend) -> str:
    return f"{openai_frontend.url}/v1"


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir.name


def test_an_agents_sdk_agent_runs_a_tool_round_trip_to_a_final_answer(base_url, model):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunHooks, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "18 degrees and sunny"

    class AnswerAfterTheTool(RunHooks):
        """The tool once (tool_choice required), then an answer (none): the model's own choice of when to
        stop calling is not what this test is about."""

        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = ModelSettings(tool_choice="none", temperature=0, max_tokens=96)

    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], reset_tool_choice=False,
                  model=OpenAIResponsesModel(model=model, openai_client=AsyncOpenAI(base_url=base_url, api_key="unused")),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=96))
    result = Runner.run_sync(agent, QUESTION, hooks=AnswerAfterTheTool(), max_turns=3)
    assert len(asked) == 1 and asked[0] and isinstance(result.final_output, str) and result.final_output
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    # The answer's prompt held the tool's output: the items the SDK sent, sent again, count the same; without
    # the output item, fewer.
    items = result.to_input_list()[:-1]
    assert items[-1]["type"] == "function_call_output" and items[-1]["output"] == "18 degrees and sunny"
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
              "parameters": get_weather.params_json_schema, "strict": True}]
    client = OpenAI(base_url=base_url, api_key="unused")
    again = [client.responses.create(model=model, input=sent, instructions="Answer with the weather tool.", tools=tools,
                                     tool_choice="none", max_output_tokens=1).usage.input_tokens for sent in (items, items[:-1])]
    assert again[0] == result.raw_responses[1].usage.input_tokens > again[1]


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_binds_tools_and_structured_output_whole_and_streamed(base_url, model, responses_api):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=64,
                     use_responses_api=responses_api)
    bound = llm.bind_tools([Weather], tool_choice="required", parallel_tool_calls=False)
    whole = bound.invoke(QUESTION).tool_calls
    chunks = list(bound.stream(QUESTION))
    streamed = sum(chunks[1:], chunks[0]).tool_calls
    for calls in (whole, streamed):
        assert [c["name"] for c in calls] == ["Weather"] and Weather.model_validate(calls[0]["args"])
    structured = llm.with_structured_output(Colour)
    assert isinstance(structured.invoke("Describe the colour of the sun."), Colour)
    assert isinstance(list(structured.stream("Describe the colour of the sun."))[-1], Colour)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_pydantic_ai_agent_calls_its_tool_and_returns_its_typed_output(base_url, model, api):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    kind = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(kind(model, provider=OpenAIProvider(base_url=base_url, api_key="unused")), output_type=Colour,
                  model_settings=ModelSettings(temperature=0, max_tokens=96, parallel_tool_calls=False))
    called: list[int] = []

    async def once(ctx, tool_def):  # offered until called: then only the output tool is left
        return None if called else tool_def

    @agent.tool_plain(prepare=once)
    def sun_colour() -> str:
        """The colour of the sun."""
        called.append(1)
        return "yellow"

    result = agent.run_sync("What colour is the sun? Use the tool.")
    assert called == [1] and isinstance(result.output, Colour)
    returned = [part for message in result.all_messages() for part in message.parts if part.part_kind == "tool-return"]
    assert any(part.tool_name == "sun_colour" and part.content == "yellow" for part in returned)
