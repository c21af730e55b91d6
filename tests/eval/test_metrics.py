"""EM and F1 against hand-computed cases (DPR normalisation)."""

import pytest

from certrag.eval.metrics import answer_in_text, exact_match, f1_score, normalize_answer, substring_match


def test_normalisation():
    assert normalize_answer("The  Beatles!") == "beatles"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert normalize_answer("Röntgen") == normalize_answer("Ro\u0308ntgen")


def test_exact_match_hand_computed():
    assert exact_match("the Beatles", ["Beatles"]) == 1.0
    assert exact_match("Beatles band", ["Beatles"]) == 0.0
    assert exact_match("Paris.", ["London", "paris"]) == 1.0
    assert exact_match("", ["x"]) == 0.0


def test_f1_hand_computed():
    # prediction "john paul jones" vs gold "paul jones": common 2, P = 2/3, R = 1, F1 = 0.8
    assert f1_score("John Paul Jones", ["Paul Jones"]) == pytest.approx(0.8)
    # best over answers
    assert f1_score("new york city", ["york", "new york city"]) == pytest.approx(1.0)
    # repeated tokens count with multiplicity: "a a b" -> "b" after article removal... use non-articles
    assert f1_score("x x y", ["x y y"]) == pytest.approx(2 / 3)
    assert f1_score("nothing", ["else"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to empty


def test_answer_in_text():
    assert answer_in_text("It was won by the Boston Red Sox in 2004.", ["Boston Red Sox"])
    assert not answer_in_text("Redsox", ["Red Sox"])


def test_substring_match_is_the_papers_raw_containment():
    # Self-RAG's "match": the gold string as written inside the prediction, case and punctuation counted
    assert substring_match("It was won by Norway in 1924.", ["Norway"]) == 1.0
    assert substring_match("norway", ["Norway"]) == 0.0  # no lower-casing (EM / answer_in_text would accept it)
    assert substring_match("sixty", ["six"]) == 1.0  # no word boundary (answer_in_text would refuse it)
    assert substring_match("6", ["six", "Six"]) == 0.0
    assert substring_match("anything", ["", "x"]) == 0.0  # an empty gold string matches nothing
