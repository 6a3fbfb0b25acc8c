"""Qwen-style chat templates for the tiny toy tokenizers (`cleaner_jax.toy.checkpoint`).

They render the same text as the public Qwen2.5-7B-Instruct / Qwen3-4B-Instruct-2507 templates
for the conversations the project produces (ChatML with a `# Tools` system section, hermes
`<tool_call>` blocks, tool results wrapped in `<tool_response>` inside a `user` turn), which is
what the agent loop and SAAR depend on; tests/test_chat_real_templates.py renders both against
copies of the real templates. Qwen2.5 adds a default system prompt when none is given; Qwen3
does not. The two families differ in one more place: Qwen2.5 always JSON-encodes a tool call's
`arguments`, so arguments given as a string come out quoted a second time; Qwen3 writes a
string as it is. Not modelled: the real templates' handling of non-string message content.
"""

_TOOLS_HEADER = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)

_BODY_TEMPLATE = """
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            ARGUMENTS
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def _header(default_system: str | None) -> str:
    with_system = (
        "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}"
        + ("{%- else %}{{- '" + default_system + "\\n\\n' }}" if default_system else "")
        + "{%- endif %}"
    )
    tools = (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}" + with_system
        + "{{- \"" + _TOOLS_HEADER + "\" }}"
        + "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        + "{{- \"" + _TOOLS_FOOTER + "<|im_end|>\\n\" }}"
    )
    no_tools = (
        "{%- else %}{%- if messages[0]['role'] == 'system' %}"
        "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    )
    if default_system:
        no_tools += "{%- else %}{{- '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
    return tools + no_tools + "{%- endif %}{%- endif %}"


QWEN2_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# How each family writes a tool call's `arguments` (see the module docstring).
_QWEN2_ARGUMENTS = "{{- tool_call.arguments | tojson }}"
_QWEN3_ARGUMENTS = (
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
)

QWEN2_CHAT_TEMPLATE = _header(QWEN2_DEFAULT_SYSTEM) + _BODY_TEMPLATE.replace("ARGUMENTS", _QWEN2_ARGUMENTS)
QWEN3_CHAT_TEMPLATE = _header(None) + _BODY_TEMPLATE.replace("ARGUMENTS", _QWEN3_ARGUMENTS)
