"""The chat template: `--chat_template` read and compiled, and its rendering errors, in one line each.

A template given on the command line (a file or the text) is compiled as transformers compiles
chat templates before any data is read, so a template that is not valid Jinja is refused at
start-up; an error a template raises while rendering a conversation names the conversation.
"""

from __future__ import annotations

import contextlib
import json
import os

from common.launch.errors import UsageError, describe


def read_chat_template(value: str) -> str:
    """`--chat_template`: a file holding a Jinja template (.jinja/.txt, or a tokenizer_config-style
    .json with a `chat_template` key), or the template itself; compiled here, so that a template
    that is not valid Jinja is refused before any data is read."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(
                f"--chat_template {value} does not read ({describe(error)}); pass a UTF-8 text file "
                "holding a Jinja template"
            ) from None
        if value.endswith(".json"):
            try:
                text = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise UsageError(
                    f'--chat_template {value}: a .json file must be an object with a "chat_template" string'
                ) from None
        if not isinstance(text, str):
            raise UsageError(
                f'--chat_template {value}: "chat_template" must be one template string; a list of '
                "named templates is not read here: pass the one to use"
            )
        check_jinja(text, f"--chat_template {value}")
        return text
    if "{{" not in value and "{%" not in value:
        raise UsageError(
            f"--chat_template {value!r} is neither a file nor a Jinja template; "
            "give a path to a template file or the template text"
        )
    check_jinja(value, "--chat_template")
    return value


def check_jinja(template: str, source: str) -> None:
    """Compile `template` as transformers compiles chat templates (jinja2 with loop controls and the
    `{% generation %}` tag; nothing is rendered): a syntax error, an unknown filter or test, is a
    UsageError naming `source` and the line."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):  # transformers' {% generation %}...{% endgeneration %}, parsed only
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    try:
        ImmutableSandboxedEnvironment(extensions=[GenerationTag, loopcontrols]).from_string(template)
    except jinja2.TemplateError as error:
        line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
        raise UsageError(
            f"{source} is not a valid Jinja template ({type(error).__name__}{line}: {error}); fix the template"
        ) from None


@contextlib.contextmanager
def template_errors(messages):
    """Rendering `messages` with the chat template: an error the template raises (raise_exception,
    a value it cannot handle) is a UsageError that shows the conversation."""
    import jinja2

    try:
        yield
    except jinja2.TemplateError as error:
        raise UsageError(
            f"the chat template (--chat_template, or the tokenizer's) does not render a conversation "
            f"({describe(error)}): fix the template or the data; the conversation: "
            f"{str(messages)[:120]}"
        ) from None
