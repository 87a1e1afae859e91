"""OpenAI Agents SDK: a triage agent hands the customer off (a scripted
`transfer_to_<agent>` tool call, which the SDK turns into a handoff) to a billing agent
with a function tool or to a tech-support agent, which answer from the conversation the
SDK hands over. Chat Completions models (OpenAIChatCompletionsModel over AsyncOpenAI),
run with Runner.run_streamed, so every answer reaches the SDK as an SSE stream."""

from __future__ import annotations

import asyncio

from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_tracing_disabled)
from openai import AsyncOpenAI

from _common import API_KEY, MAX_TOKENS, MODEL, TEMPERATURE, RecorderClient, Run, parse_args, tool_call

APP = "openai_agents"
INVOICES = {
    "INV-1042": "Invoice INV-1042: 49.90 EUR, paid twice on 3 March (card ending 4411); second payment refundable.",
    "INV-2210": "5.00",
}
TASKS = [
    "I was charged twice for invoice INV-1042. Can you check it?",
    "My router keeps disconnecting every evening. What should I try?",
    "Why is there a late fee on invoice INV-2210?",
]
RUNS = [Run("r1", TASKS[0]), Run("r2", TASKS[1], "g1"), Run("r3", TASKS[2], "g1"), Run("r4", TASKS[0])]
# Per task: agent -> its requests in order (scripted tool calls, or None: the model answers).
SCRIPTS = {
    TASKS[0]: {"triage": [tool_call("transfer_to_billing_agent")],
               "billing_agent": [tool_call("get_invoice", invoice_id="INV-1042"), None]},
    TASKS[1]: {"triage": [tool_call("transfer_to_tech_agent")], "tech_agent": [None]},
    TASKS[2]: {"triage": [tool_call("transfer_to_billing_agent")],
               "billing_agent": [tool_call("get_invoice", invoice_id="INV-2210"), None]},
}


@function_tool
def get_invoice(invoice_id: str) -> str:
    """The billing record of an invoice (a late fee is shown as its amount in euros)."""
    return INVOICES.get(invoice_id, "No such invoice.")


def model(recorder: RecorderClient, run: str, agent: str) -> OpenAIChatCompletionsModel:
    client = AsyncOpenAI(base_url=recorder.base_url(run, agent), api_key=API_KEY)
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


async def one_run(recorder: RecorderClient, run: Run) -> None:
    for agent, steps in SCRIPTS[run.task].items():
        recorder.script(run.run, agent, steps)
    settings = ModelSettings(temperature=TEMPERATURE, max_tokens=MAX_TOKENS)
    billing = Agent(name="billing_agent", model=model(recorder, run.run, "billing_agent"), model_settings=settings,
                    instructions="You handle billing questions. Look up the invoice, then explain it briefly.",
                    tools=[get_invoice])
    tech = Agent(name="tech_agent", model=model(recorder, run.run, "tech_agent"), model_settings=settings,
                 instructions="You are technical support. Suggest two simple things to try.")
    triage = Agent(name="triage", model=model(recorder, run.run, "triage"), model_settings=settings,
                   instructions="You route customers: billing questions to billing_agent, "
                                "technical problems to tech_agent.",
                   handoffs=[billing, tech])
    result = Runner.run_streamed(triage, run.task)
    async for _ in result.stream_events():
        pass  # the events are the SDK's business; the capture is the HTTP traffic


async def main() -> None:
    set_tracing_disabled(True)  # the SDK would otherwise export traces to OpenAI
    recorder, out = parse_args(APP)
    for run in RUNS:
        recorder.register_run(run)
    await one_run(recorder, RUNS[0])
    await asyncio.gather(one_run(recorder, RUNS[1]), one_run(recorder, RUNS[2]))
    await one_run(recorder, RUNS[3])
    print(recorder.save("openai-agents", __doc__.split("\n\n")[0].replace("\n", " "), out))


if __name__ == "__main__":
    asyncio.run(main())
