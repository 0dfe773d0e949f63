"""The xPRT paper's published numbers, as the paper summary (/work/shared/papers/xprt.md) states them, each with the
sentence it comes from, keyed by the harness's arm names so the results page can set ours beside them.

Scores are x100. "delta" = difference to the start model (E5 setting) or to xPRT (ablations). A number the paper does
not give is absent, never guessed; where the paper gives a range or words only, the text is kept as it is.
"""

# Continued pre-training from E5-base-unsupervised (paper Table 1): 41 tasks of MTEB(eng, v2), no fine-tuning.
E5_SETTING = {
    "average_delta": {
        "xprt": ("+1.80 to +1.87", "xPRT gains 1.80 to 1.87 points consistently (100K, 500K, 1M documents)"),
        "baselines": ("at most +0.38", "five established objectives gain at most 0.38 points on the 41-task MTEB "
                                       "average"),
        "revela": ("-0.05 to -0.26", "Revela stays below the E5 starting point at all three sizes, by 0.05 to 0.26"),
    },
    "tasks_above_start": ("34 of 41", "At 100K, xPRT beats E5 on 34 of the 41 tasks"),
    "category_delta": {
        "STS": ("+3.5", "At 100K, STS rises 3.5 points"),
        "Retrieval": ("+2.5", "and retrieval 2.5 points"),
        "Reranking": ("~0", "while reranking barely moves"),
    },
    "task_delta": {
        "ArguAna": ("+5.8", "ArguAna +5.8"),
        "Touche2020Retrieval.v3": ("+6.6", "Touche-2020 +6.6"),
        "TRECCOVID": ("-1.4", "TREC-COVID by 1.4"),
        "FiQA2018": ("-1.1", "FiQA by 1.1"),
    },
    "retrieval_100k_to_1m": ("45.78 -> 45.33", "retrieval nDCG@10 even falls from 45.78 to 45.33"),
    "overlap_thirds": {
        "xprt": ("+3.7 to +8.8 in every third", "xPRT beats E5 in every third by 3.7 to 8.8 points (ArguAna)"),
        "bow_dpr": ("-10.3 in the lowest third", "BoW-DPR ... loses 10.3 points in the lowest-overlap third"),
    },
    "fine_tuning": ("not tested", "every evaluation is without fine-tuning ... whether fine-tuning erases that gap "
                                  "is the first thing to test"),
}

# Training from BERT (100K documents, six epochs; paper Tables 1 and 3).
FROM_MLM_SETTING = {
    "average": {"xprt": (47.12, "xPRT averages 47.12"), "simlm": (42.73, "against 42.73 for SimLM, the strongest "
                                                                         "baseline")},
    "retrieval": {"xprt": (29.21, "retrieval nDCG@10 is 29.21"), "simlm": (20.68, "against 20.68")},
    # ablations, as differences to xPRT's average (paper Table 3, in the BERT setting)
    "ablation_delta": {
        "no_fill_in": ("-0.45", "Removing the fill-in loss costs only 0.45 points"),
        "random_positive": ("-4.9", "replacing the positive with a random passage costs 4.9 points and drops below "
                                    "SimLM"),
        "e5_ranking": ("-2.3", "ranking by E5 cosine alone costs 2.3 points"),
        "tfidf_ranking": ("level", "TF-IDF alone stays level with the fused ranking, with slightly higher retrieval "
                                   "scores"),
        "self_reconstruction_5x": ("retrieval 18.8-19.2", "Giving self-reconstruction as much text or more, with up "
                                                          "to five times the steps, still leaves retrieval at 18.8 "
                                                          "to 19.2"),
    },
}
