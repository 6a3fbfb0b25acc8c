"""The authors' prompt text, exactly (docs/authors.md §7).

The wording matters: rewards parse `\\boxed{}` from the end of the response and code rewards
look for a ```python block, and the checkpoints were SFT'd on these instructions. The typo
"sumbit" is the authors'.
"""
from __future__ import annotations

MATH1 = "Analyze and solve the following math problem step by step. \n\n"
MATH2 = (
    "\n\nThe tool could be used for more precise and efficient calculation and could help you "
    "to verify your result before you reach the final answer."
)
AGENT = (
    "\n\n**Note: You should first analyze the problem and form a high-level solution strategy, "
    "then utilize the tools to help you solve the problem.**"
)
ANSFMT = (
    "\nRemember once you make sure the current answer is your final answer, do not call the "
    "tools again and directly output the final answer in the following text format, the answer "
    "format must be: \\boxed{'The final answer goes here.'}."
)
UNITS = (
    "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be "
    "the numerical value of the final answer only, without any units."
)
UNITS2 = (
    "\nDo not put units of the final answer inside \\boxed{}. The content of \\boxed{} should be "
    "the final numerical value of the final answer only, without any units."
)
SUBMIT = (
    "\nBefore sumbit your code, you can utilize tools to check the correctness of your code, once "
    "you make sure the current code is correct, do not call the tools again and submit your code "
    "within ```python\n# YOUR CODE HERE\n```."
)
NOTOOL_SUBMIT = (
    "\nOnce you make sure the current code is correct, submit your code within "
    "```python\n# YOUR CODE HERE\n```."
)
GPQA_SUFFIX = "\n Here you need to put the final uppercase letter option of this problem into \\boxed{}"
CODE_HEAD = (
    "You will be given a question (problem specification) and will generate a correct Python "
    "program that matches the specification and passes all tests.\n\n"
)
# LiveCodeBench (the authors' `map_lcb`): the stdin/stdout instruction ends in an unclosed code
# fence and a stray `"` (docs/authors.md §9.16); kept, the checkpoints were evaluated on it.
LCB_EXAMPLES = "\nHere are some input and output examples of the expected code:\nInput:"
LCB_STDIN = (
    "\n\nRead the inputs from stdin solve the problem and write the answer to stdout (do not "
    "directly test on the sample inputs). Enclose your code within delimiters as follows. Ensure "
    "that when the python program runs, it reads the inputs, runs the algorithm and writes output "
    "to STDOUT.\n```python\n# YOUR CODE HERE\n\""
)
# Functional (LeetCode-style) LiveCodeBench problems: the authors' file has none and their prompt
# asks for a stdin program, which such tests cannot run. This replaces LCB_STDIN there with
# LiveCodeBench's own starter-code instruction (a deviation forced by the data, no option).
LCB_STARTER = (
    "\n\nYou will use the following starter code to write the solution to the problem and enclose "
    "your code within delimiters.\n```python\n{starter_code}\n```"
)


def math_eval_prompt(problem: str, *, tool: bool = True) -> str:
    """AIME/AMC/MATH evaluation prompt (tool variant = P1 + problem + P2 + AGENT + ANSWER)."""
    return MATH1 + problem + (MATH2 + AGENT if tool else "") + ANSFMT


def gpqa_eval_prompt(problem: str, domain: str, *, tool: bool = True) -> str:
    """The authors' GPQA prompt (`map_fn_gpqa`): the domain names the problem ("Analyze and solve
    the following Physics problem ..."), the options are already in `problem`, and the answer is
    one boxed uppercase letter."""
    head = f"Analyze and solve the following {domain} problem step by step. \n\n"
    return head + problem + (MATH2 + AGENT if tool else "") + ANSFMT + GPQA_SUFFIX


def train_prompt_faithful(stored_prompt: str) -> str:
    """What the authors' training pipeline actually appends to *every* Open-AgentRL row.

    Their dataset class picks the mapping from the first row's data_source (math_dapo), so
    code rows get the math UNITS suffix too (docs/authors.md §7.1).
    """
    return stored_prompt + UNITS


def code_eval_prompt(problem: str, *, tool: bool = True) -> str:
    """A HumanEval/LeetCode-style prompt in the authors' code-submission format."""
    return CODE_HEAD + problem + (AGENT + SUBMIT if tool else NOTOOL_SUBMIT)


def lcb_eval_prompt(problem: str, public_inputs: list[str], public_outputs: list[str], *,
                    tool: bool = True, starter_code: str | None = None) -> str:
    """The authors' LiveCodeBench prompt: head + problem + the public tests as Python list reprs
    (`str(inputs)`, as `map_lcb` prints them) + AGENT + the stdin instruction + SUBMIT; the no-tool
    variant drops AGENT and SUBMIT. `starter_code` (functional problems only) swaps the stdin
    instruction for LCB_STARTER."""
    examples = LCB_EXAMPLES + str(list(public_inputs)) + "\nOutput:\n" + str(list(public_outputs))
    fmt = LCB_STDIN if starter_code is None else LCB_STARTER.format(starter_code=starter_code)
    return CODE_HEAD + problem + examples + (AGENT if tool else "") + fmt + (SUBMIT if tool else "")
