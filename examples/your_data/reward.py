import re


def score(completion: str, item: dict) -> float:
    numbers = re.findall(r"-?\d+", completion)
    return 1.0 if numbers and numbers[-1] == item["answer"] else 0.0
