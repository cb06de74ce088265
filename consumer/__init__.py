"""The drafter trainer, in rooms: the drafter families (families/), the model and the target's frozen head
(modeling/), the trainer process and its training (training/), the loss terms (objectives/), what it reports
(reporting/), offline evaluation (evaluation/), and the layouts drafters are exported in and imported from
(layouts/)."""
