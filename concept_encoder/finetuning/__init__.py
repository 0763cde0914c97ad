"""What fine-tuning reports beside the loop's training: the best dev step (`selection`), frozen features and
linear probes (`probe`), a token encoder reading a long input in chunks (`chunked`), and the report that
gathers fine-tuning runs into one table (`report`, `python -m concept_encoder finetune_report`)."""
