"""pytest plugin (``-p slime_contract_plugin``) for running slime's generate-contract tests against
``slime_ascend.compaction.generate.generate``: installs an offline tokenizer and a fake engine."""

from compaction_fakes import BareTinyTokenizer, FakeEngine, memory_policy

from slime_ascend.compaction.generate import CompactionRuntime, set_runtime_override

_tok = BareTinyTokenizer()
set_runtime_override(CompactionRuntime(tokenizer=_tok, engine=FakeEngine(_tok, memory_policy)))
