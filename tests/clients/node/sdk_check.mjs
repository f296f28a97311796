// The OpenAI Node SDK against the gateway, as a Node developer would call it.
// Usage: node sdk_check.mjs BASE_URL API_KEY MODEL TOOL_JSON TOOL_MESSAGES_JSON
// Prints one JSON line with what each call gave; tests/clients/test_openai_node.py
// asserts on it. A call that throws unexpectedly is reported under its name as
// {"threw": {...}} so the Python side shows what went wrong.
import OpenAI from "openai";

const [baseURL, apiKey, model, toolJSON, toolMessagesJSON] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 60_000 });
const messages = [{ role: "user", content: "Hello" }];
const weather = JSON.parse(toolJSON);
const toolMessages = JSON.parse(toolMessagesJSON);

function describe(e) {
  return {
    name: e?.constructor?.name ?? typeof e,
    status: e?.status ?? null,
    code: e?.code ?? null,
    codeType: typeof e?.code,
    type: e?.type ?? null,
    param: e?.param ?? null,
    requestID: e?.requestID ?? null,
    message: String(e?.message ?? e),
  };
}

async function chat() {
  const { data, response } = await client.chat.completions
    .create({ model, messages, max_tokens: 8, temperature: 0 })
    .withResponse();
  return {
    content: data.choices[0].message.content,
    finish: data.choices[0].finish_reason,
    completionTokens: data.usage?.completion_tokens ?? null,
    requestID: response.headers.get("x-request-id"),
  };
}

async function stream() {
  const chunks = await client.chat.completions.create({
    model,
    messages,
    max_tokens: 8,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let count = 0;
  let usage = null;
  let finish = null;
  for await (const chunk of chunks) {
    count += 1;
    for (const choice of chunk.choices) {
      text += choice.delta?.content ?? "";
      finish = choice.finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage.completion_tokens;
  }
  return { text, count, usage, finish };
}

async function tools() {
  const data = await client.chat.completions.create({
    model,
    messages: toolMessages,
    tools: [weather],
    tool_choice: "required",
    max_tokens: 200,
    temperature: 0,
  });
  const calls = data.choices[0].message.tool_calls ?? [];
  return {
    finish: data.choices[0].finish_reason,
    calls: calls.map((c) => ({ id: c.id, type: c.type, name: c.function.name, arguments: c.function.arguments })),
  };
}

async function expectError(call) {
  try {
    await call();
  } catch (e) {
    return describe(e);
  }
  return { threw: false };
}

const out = { node: process.version };
for (const [name, run] of Object.entries({
  chat,
  stream,
  tools,
  badTemperature: () =>
    expectError(() => client.chat.completions.create({ model, messages, max_tokens: 4, temperature: 5 })),
  overlong: () =>
    expectError(() =>
      client.chat.completions.create({
        model,
        messages: [{ role: "user", content: "word ".repeat(2000) }],
        max_tokens: 4,
      }),
    ),
  notFound: () => expectError(() => client.chat.completions.create({ model: "no-such-model", messages })),
})) {
  try {
    out[name] = await run();
  } catch (e) {
    out[name] = { threw: describe(e) };
  }
}
console.log(JSON.stringify(out));
