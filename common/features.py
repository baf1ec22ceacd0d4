"""The features of the feature judge (`judge_backbone: features`), after Tan et al. 2016, "Winning
Arguments": how a reply interplays with the original post, and its style.

Interplay (word types, lower case): how many the reply shares with the post, split into stop words
(scikit-learn's English list) and content words, their Jaccard overlaps, the share of the reply's
words that are in the post and of the post's that are in the reply. Style: length in words,
paragraphs, hedges, definite and indefinite articles, second-person pronouns, questions, quoted lines
(`>`), quotation marks, links, examples ("for example", "e.g.", ...) and numbers. Counts are log1p:
a pair's two replies are length-balanced by stage 01, and the difference of logs is a ratio.
Form (the gibberish audit's kinds, common/corruptions.py): the share of word pairs that are common English
ones ("of the", "it is": shuffled words and word salad break them), distinct word pairs (repetition),
repeated sentences, whether the reply ends a sentence (a cut reply does not), the share of its 5-grams
found in the post (a copy of it) and the share of stop words.
`features(premise, reply)` gives those in the order of TEXT_FEATURES.
Topic (fitted, `Topic`): the cosine of the reply's and the post's tf-idf vectors (`word_tfidf` without
stop words, fitted on the train posts and replies), and that cosine cut at `floor`, a low quantile of
the train replies' own.
Winners share fewer words with the post than losers do (Tan et al. found the same), so a judge fitted on
the pairs alone rewards an unrelated reply; the cut feature is constant over most real replies and tells
the judge, from the `other_post` corruption pairs, what too little in common costs.
"""
from __future__ import annotations

import math
import re

import numpy as np
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

# Bumped whenever what a feature measures changes: a saved feature judge records it and is refused
# by a version of this module that would compute other numbers.
FEATURES_VERSION = 3  # 2: the form features; 3: the topic features

HEDGES = ("might", "perhaps", "maybe", "possibly", "probably", "could be", "may be", "seems", "seem",
          "i think", "i believe", "i guess", "likely", "somewhat", "arguably", "it appears", "sort of", "kind of")
EXAMPLES = ("for example", "for instance", "e.g.", "such as", "to illustrate")
SECOND_PERSON = {"you", "your", "yours", "yourself", "yourselves", "you're", "you've", "you'd", "you'll"}

INTERPLAY = ["shared_words", "shared_stop_words", "shared_content_words", "jaccard_words", "jaccard_stop_words",
             "jaccard_content_words", "reply_words_in_op", "op_words_in_reply"]
STYLE = ["log_words", "paragraphs", "hedges", "definite_articles", "indefinite_articles", "second_person",
         "questions", "quoted_lines", "quotation_marks", "links", "examples", "numbers"]
FORM = ["common_bigrams", "distinct_2", "repeated_sentences", "ends_a_sentence", "premise_5grams", "stop_word_share"]
TEXT_FEATURES = INTERPLAY + STYLE + FORM
TOPIC = ["topic_cosine", "topic_cosine_to_floor"]
FEATURE_NAMES = TEXT_FEATURES + TOPIC
TOPIC_FLOOR_QUANTILE = 0.1  # of the train replies' cosines: the cut feature is flat above it for 90% of them

# Frequent English word pairs, mostly of function words: in running text a few in a hundred pairs, in
# the same words shuffled or drawn at random almost none.
COMMON_BIGRAMS = frozenset((
    "of the", "in the", "to the", "on the", "and the", "for the", "to be", "it is", "that the", "is a", "with the",
    "is the", "at the", "from the", "by the", "i think", "do not", "does not", "is not", "you are", "if you", "in a",
    "of a", "as a", "it's not", "there is", "there are", "that is", "this is", "can be", "have to", "want to",
    "need to", "would be", "will be", "has been", "have been", "a lot", "lot of", "one of", "some of", "such as",
    "more than", "rather than", "you can", "you have", "they are", "we are", "i don't", "don't think", "going to",
    "the same", "because the", "and i", "but i", "if the", "what you"))
SENTENCE = re.compile(r"(?<=[.!?])\s+")
ENDS_SENTENCE = re.compile(r"[.!?][\"')\]]*$")

WORD = re.compile(r"[a-z0-9][a-z0-9']*")
LINK = re.compile(r"https?://|www\.", re.I)
NUMBER = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*%?")
QUOTES = re.compile(r"[\"“”]")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def _phrases(text: str, phrases) -> int:
    """Occurrences of each phrase as whole words (\"e.g.\" too)."""
    low = " " + " ".join(text.lower().split()) + " "
    return sum(len(re.findall(r"(?<![\w])" + re.escape(p) + r"(?![\w])", low)) for p in phrases)


def interplay(premise: str, reply: str) -> list[float]:
    op, rep = set(words(premise)), set(words(reply))
    stop = set(ENGLISH_STOP_WORDS)
    op_stop, rep_stop, op_content, rep_content = op & stop, rep & stop, op - stop, rep - stop
    return [math.log1p(len(op & rep)), math.log1p(len(op_stop & rep_stop)), math.log1p(len(op_content & rep_content)),
            _jaccard(op, rep), _jaccard(op_stop, rep_stop), _jaccard(op_content, rep_content),
            len(op & rep) / len(rep) if rep else 0.0, len(op & rep) / len(op) if op else 0.0]


def style(reply: str) -> list[float]:
    tokens = words(reply)
    lines = reply.splitlines()
    counts = [
        len([p for p in re.split(r"\n\s*\n", reply) if p.strip()]),
        _phrases(reply, HEDGES),
        tokens.count("the"),
        tokens.count("a") + tokens.count("an"),
        sum(t in SECOND_PERSON for t in tokens),
        reply.count("?"),
        sum(line.lstrip().startswith(">") for line in lines),
        len(QUOTES.findall(reply)),
        len(LINK.findall(reply)),
        _phrases(reply, EXAMPLES),
        len(NUMBER.findall(reply)),
    ]
    return [math.log1p(len(reply.split()))] + [math.log1p(c) for c in counts]


def form(premise: str, reply: str) -> list[float]:
    tokens = words(reply)
    pairs = [f"{a} {b}" for a, b in zip(tokens, tokens[1:])]
    sentences = [s.strip().lower() for s in SENTENCE.split(reply) if s.strip()]
    post_5grams = set(zip(*[words(premise)[i:] for i in range(5)]))
    reply_5grams = list(zip(*[tokens[i:] for i in range(5)]))
    return [sum(p in COMMON_BIGRAMS for p in pairs) / max(1, len(pairs)),
            len(set(pairs)) / max(1, len(pairs)),
            1 - len(set(sentences)) / max(1, len(sentences)),
            1.0 if ENDS_SENTENCE.search(reply.strip()) else 0.0,
            sum(g in post_5grams for g in reply_5grams) / max(1, len(reply_5grams)),
            sum(t in ENGLISH_STOP_WORDS for t in tokens) / max(1, len(tokens))]


def features(premise: str, reply: str) -> list[float]:
    """One reply's text features (TEXT_FEATURES' order) against the post it answers."""
    return interplay(premise, reply) + style(reply) + form(premise, reply)


def word_tfidf(stop_words: str | None = None, vocabulary: dict | None = None):
    """The project's tf-idf of words (every bag-of-words baseline, and the topic features): lower-cased
    words seen in at least two fitting texts, 1 + log of the count, smoothed idf, unit length."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    return TfidfVectorizer(lowercase=True, min_df=2, max_features=20000, sublinear_tf=True,
                           token_pattern=r"(?u)\b\w[\w']*\b", stop_words=stop_words, vocabulary=vocabulary)


class Topic:
    """The topic features of replies to posts: [cosine, min(cosine, floor)] of their tf-idf vectors
    (word_tfidf without scikit-learn's English stop words, fitted on the posts and replies given to `fit`)."""

    def __init__(self, vectorizer, floor: float):
        self.vectorizer, self.floor = vectorizer, float(floor)  # vectorizer None: no word in two texts

    @classmethod
    def fit(cls, posts: list[str], replies: list[str]) -> "Topic":
        """idf from the distinct posts and the replies; floor: TOPIC_FLOOR_QUANTILE of the replies' cosines
        with their posts (`posts[i]` is `replies[i]`'s post)."""
        try:
            vectorizer = word_tfidf("english").fit(list(dict.fromkeys(posts)) + list(replies))
        except ValueError:  # scikit-learn's "empty vocabulary"
            vectorizer = None
        topic = cls(vectorizer, 0.0)
        cosines = np.sort(topic.cosines(posts, replies))
        topic.floor = float(cosines[int(TOPIC_FLOOR_QUANTILE * (len(cosines) - 1))]) if len(cosines) else 0.0
        return topic

    def cosines(self, premises: list[str], replies: list[str]) -> np.ndarray:
        if self.vectorizer is None or not replies:
            return np.zeros(len(replies))
        p, r = self.vectorizer.transform(premises), self.vectorizer.transform(replies)
        return np.asarray(p.multiply(r).sum(axis=1)).ravel()

    def cosine(self, premise: str, reply: str) -> float:
        return float(self.cosines([premise], [reply])[0])

    def features(self, premises: list[str], replies: list[str]) -> np.ndarray:
        """One row a reply, in TOPIC's order."""
        c = self.cosines(premises, replies)
        return np.column_stack([c, np.minimum(c, self.floor)])

    def to_json(self) -> dict:
        v = self.vectorizer
        return {"vocabulary": {w: int(i) for w, i in v.vocabulary_.items()} if v else {},
                "idf": v.idf_.tolist() if v else [], "floor": self.floor}

    @classmethod
    def from_json(cls, saved: dict) -> "Topic":
        vectorizer = None
        if saved["vocabulary"]:
            vectorizer = word_tfidf("english", vocabulary=saved["vocabulary"])
            vectorizer.idf_ = np.asarray(saved["idf"], dtype=float)
        return cls(vectorizer, saved["floor"])


def premise_text(prompt: list[dict]) -> str:
    """The original post as a judge reads it: the prompt's user turns, without the system turn."""
    return "\n\n".join(m["content"] for m in prompt if m["role"] != "system")
