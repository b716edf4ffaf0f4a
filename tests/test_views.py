"""rsi/mol/views.py: a person's plain message read as a family's task, or refused; what the pair answered said
back. The proxy's use of views, on real specialists, is tests/test_serve.py's
``test_a_person_asks_in_plain_words_and_gets_the_pairs_answer_back_in_plain_words``."""

from __future__ import annotations

import pytest

from rsi.mol.views import VIEWS, read_list, read_sum

SUMS = ["12+34", "12+34=", "12 + 34", "12 + 34 =", "12 plus 34", "what is 12 plus 34?", "What's 12+34?",
        "whats 12 + 34", "how much is 12 plus 34?", "Calculate 12 + 34.", "compute 12+34 please", "add 12 and 34",
        "Add 12 to 34!", "please add 12 and 34", "Could you please add 12 to 34?",
        "can you tell me what 12 plus 34 is?", "the sum of 12 and 34", "What is the sum of 12 and 34?",
        "total of 12 and 34", "12 and 34 added together",
        "hi, what is 12 plus 34? thanks", "  12   +   34  ", "12 + 34 equals what?", "what is 12 added to 34",
        # read by the words of asking and adding (rsi.mol.views._general_sum), not by a pattern of their own
        "I want to know 12 plus 34", "12 plus 34 makes what?", "show me 12 + 34", "what is 12 + 34 equal to",
        "hey, could you figure out 12 plus 34 for me", "add together 12 and 34", "give me the total: 12 + 34"]
NOT_SUMS = ["hello!", "what is the capital of France?", "1+2+3", "-12+34", "1.5+2", "12 - 34", "12 times 34",
            "add them", "what is 12?", "sort 3 1 4 1 5 9 2", "12+", "+34", "", "tell me a joke about 12 and 34",
            "I have 12 cats and 34 dogs", "what is 12 plus 34 minus 5", "is 12 and 34 a good pair?",
            "what's 2 to the power of 10?", "12,000 + 34", "what is 12 plus 34 times 2", "add 12 to my list of 34"]
LISTS = ["sort 3 1 4 1 5 9 2", "Sort 3,1,4,1,5,9,2 please", "put 3 1 4 1 5 9 2 in order", "sort: 3141592",
         "order these numbers: 3 1 4 1 5 9 2", "[3, 1, 4, 1, 5, 9, 2] sorted", "please sort [3,1,4,1,5,9,2]",
         "arrange 3 1 4 1 5 9 2 in ascending order", "sort the list 3 1 4 1 5 9 2 from smallest to largest",
         # read by the words of asking and sorting (rsi.mol.views._general_list)
         "could you put the digits 3 1 4 1 5 9 2 in increasing order?", "3,1,4,1,5,9,2 - sort", "rank 3 1 4 1 5 9 2",
         "I want 3 1 4 1 5 9 2 sorted from lowest to highest"]
NOT_LISTS = ["sort 3 1 2", "sort 3 1 4 1 5 9 2 6", "sort 31 4 1 5 9 2 7", "sort my life out", "hello", "12 + 34",
             "sort -3 1 4 1 5 9 2", "sort 3 1 4 1 5 9 2 by color", "3 1 4 1 5 9 2", "sort 3.1 4 1 5 9 2 6",
             "reverse 3 1 4 1 5 9 2"]


@pytest.mark.parametrize("text", SUMS)
def test_an_addition_asked_in_plain_words_is_read(text: str) -> None:
    assert read_sum(text) == {"a": 12, "b": 34}


@pytest.mark.parametrize("text", NOT_SUMS)
def test_what_is_not_an_addition_of_two_whole_numbers_is_refused(text: str) -> None:
    assert read_sum(text) is None


@pytest.mark.parametrize("text", LISTS)
def test_a_list_to_sort_asked_in_plain_words_is_read(text: str) -> None:
    assert read_list(text) == {"items": [3, 1, 4, 1, 5, 9, 2]}


@pytest.mark.parametrize("text", NOT_LISTS)
def test_what_is_not_a_list_the_family_sorts_is_refused(text: str) -> None:
    assert read_list(text) is None


def test_the_answer_is_said_as_the_pair_gave_it() -> None:
    assert VIEWS["addition"].say({"a": 12, "b": 34}, 47) == "12 + 34 = 47"  # the pair's answer, right or not
    assert VIEWS["sorting"].say({"items": [3, 1, 2]}, {"state": {"items": [1, 3, 2]}, "answer": "done"}) == \
        "sorted: 1 3 2"


@pytest.mark.parametrize("harness", ["addition/v2", "sorting/v1"])
def test_the_harnesss_own_prompt_is_told_from_a_message_no_view_reads(harness: str) -> None:
    """The proxy sends a message that no view reads and that is not the specialist's own prompt to the base, never
    to the specialist's raw format: so each built-in family's own prompt must be recognizable (TaskFamily.read)."""
    from types import SimpleNamespace

    from rsi.hcp import load_harness
    from rsi.mol.views import knows_own, own_prompt

    champion = SimpleNamespace(harness=load_harness(harness))
    payload = {"a": 12, "b": 34} if harness.startswith("addition") else {"items": [3, 1, 4, 1, 5, 9, 2]}
    prompt = champion.harness.prompt(payload)
    assert knows_own(champion) and own_prompt(champion, prompt)
    for other in ("sort these words: banana apple cherry", "tell me a joke", prompt + " please", "x" + prompt, ""):
        assert not own_prompt(champion, other), other
