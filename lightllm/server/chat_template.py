"""`--chat_template`: a Jinja chat template that replaces the checkpoint's (a checkpoint without one, a template
with the tool-calling or thinking format a deployment wants). Given as a file or as the template text; its syntax
is checked at start-up, in the sandboxed environment transformers renders chat templates in (with its extensions:
loop controls and `{% generation %}`)."""

from __future__ import annotations

import os

import jinja2


def read_chat_template(value: str) -> str:
    """The template `value` names: the file's text when `value` is a file, else `value` itself when it holds Jinja
    markup. ValueError naming the flag when it is neither, or when the template does not parse."""
    # imported here: transformers is slow to import, and the flags are read before anything else needs it
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                template, where = f.read(), value
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat_template {value}: cannot read it as UTF-8 text ({exc})") from None
    elif "{{" in value or "{%" in value:
        template, where = value, "the template text"
    else:
        raise ValueError(f"--chat_template {value!r}: no such file, and no Jinja markup ({{{{ or {{%) to use as one")
    try:
        # transformers' own compiler: a bare jinja environment lacks its extensions and refuses valid templates
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"--chat_template: {where}, line {exc.lineno}: {exc.message}") from None
    return template
