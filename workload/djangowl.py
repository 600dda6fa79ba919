"""The django workload's bug catalogue and test command (see workload/prepare_django.py).

Each mutation puts a one-line bug back into a function of Django 4.2 that Django's own
test suite covers (the modules named with it), with plausible wrong fixes; the tests run
as Django's contributors run them: ``python3 tests/runtests.py --settings=test_sqlite``
with the test labels, in the repository, on the environment in the workspace.
``python3 -m workload.tasks --workload django --verify`` checks every mutation with the
real suite (the pristine code passes, the bug fails some tests, every decoy fails one).
"""

from typing import List, Sequence

from .tasks import Kind, Mutation

P = "django/"
UT = "utils_tests."

CATALOGUE = [
    Mutation("text.slugify-strip", P + "utils/text.py", "slugify", "wrong constant",
             r'''    return re.sub(r"[-\s]+", "-", value).strip("-_")''',
             r'''    return re.sub(r"[-\s]+", "-", value).strip("-")''',
             (r'''    return re.sub(r"[-\s]+", "-", value).strip("_")''',
              r'''    return re.sub(r"[\s]+", "-", value).strip("-_")''',
              r'''    return re.sub(r"[-\s]+", "_", value).strip("-_")'''),
             (UT + "test_text",)),
    Mutation("text.chars-end", P + "utils/text.py", "Truncator._text_chars", "off-by-one",
             "            if end_index is None and s_len > truncate_len:",
             "            if end_index is None and s_len >= truncate_len:",
             ("            if end_index is None and s_len > length:",
              "            if end_index is not None and s_len > truncate_len:",
              "            if end_index is None and s_len > truncate_len + 1:"),
             (UT + "test_text",)),
    Mutation("text.phone2numeric", P + "utils/text.py", "phone2numeric", "wrong constant",
             '    return "".join(char2number.get(c, c) for c in phone.lower())',
             '    return "".join(char2number.get(c, c) for c in phone.upper())',
             ('    return "".join(char2number.get(c, c) for c in phone.title())',
              '    return "".join(char2number.get(c, c) for c in phone.swapcase())',
              '    return "".join(char2number.get(c, c) for c in phone.lower()[::-1])'),
             (UT + "test_text",)),
    Mutation("text.unescape-quote", P + "utils/text.py", "unescape_string_literal", "off-by-one",
             r'''    if not s or s[0] not in "\"'" or s[-1] != s[0]:''',
             r'''    if not s or s[0] not in "\"'" or s[-1] != s[1]:''',
             (r'''    if not s or s[0] not in "\"'" or s[0] != s[0]:''',
              r'''    if not s or s[0] not in "'" or s[-1] != s[0]:''',
              r'''    if not s or s[-1] not in "\"'":'''),
             (UT + "test_text",)),
    Mutation("text.text-list-last", P + "utils/text.py", "get_text_list", "off-by-one",
             '        _(", ").join(str(i) for i in list_[:-1]),',
             '        _(", ").join(str(i) for i in list_[:-2]),',
             ('        _(", ").join(str(i) for i in list_[1:]),', '        _(",").join(str(i) for i in list_[:-1]),',
              '        _(", ").join(str(i) for i in list_),'),
             (UT + "test_text",)),
    Mutation("http.base36-limit", P + "utils/http.py", "base36_to_int", "off-by-one",
             "    if len(s) > 13:",
             "    if len(s) > 14:",
             ("    if len(s) > 36:", "    if len(s) < 13:", "    if len(s) == 13:"),
             (UT + "test_http",)),
    Mutation("http.base36-order", P + "utils/http.py", "int_to_base36", "swapped condition",
             "        b36 = char_set[n] + b36",
             "        b36 = b36 + char_set[n]",
             ("        b36 = char_set[n]", "        b36 = char_set[i] + b36", "        b36 = char_set[n - 1] + b36"),
             (UT + "test_http",)),
    Mutation("numberformat.dec-pad", P + "utils/numberformat.py", "format", "off-by-one",
             '        dec_part += "0" * (decimal_pos - len(dec_part))',
             '        dec_part += "0" * (decimal_pos - len(dec_part) - 1)',
             ('        dec_part += "0" * decimal_pos', '        dec_part += "0" * (decimal_pos - len(dec_part) + 1)',
              '        dec_part = "0" * (decimal_pos - len(dec_part))'),
             (UT + "test_numberformat",)),
    Mutation("numberformat.group-reset", P + "utils/numberformat.py", "format", "wrong constant",
             "                cnt = 0",
             "                cnt = 1",
             ("                cnt = -1", "                cnt += 1", "                cnt = active_interval"),
             (UT + "test_numberformat",)),
]

# Run in the repository: Django's own runner, sqlite, one process (the machine's cores
# are the bench's, and a parallel run's start-up costs more than these modules take).
REPO_ENV = {"PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": "/workspace/repo:/workspace/env/site-packages"}


def test_argv(labels: Sequence[str]) -> List[str]:
    return ["python3", "tests/runtests.py", "--settings=test_sqlite", "--parallel=1", "--noinput"] + list(labels)


KIND = Kind(name="django", catalogue=CATALOGUE, test_prefix="", files_prefix="repo/",
            argv=test_argv, env=REPO_ENV,
            whole=[UT + "test_text", UT + "test_http", UT + "test_numberformat"],
            modules=[UT + "test_text", UT + "test_http", UT + "test_numberformat"],
            install_message="django: Django 4.2 with its test suite, a task's bugs injected")
