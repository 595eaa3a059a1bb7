ChatCompletionMessageParam = dict
