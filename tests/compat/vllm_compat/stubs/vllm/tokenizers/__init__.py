"""get_tokenizer for the served names of the local stand-ins."""

import transformers


def get_tokenizer(tokenizer_name, **kwargs):
    from tests.conftest import local_path

    return transformers.AutoTokenizer.from_pretrained(local_path(tokenizer_name))
