"""How alerts come in: webhook payloads parsed and screened, pull mode's polls, and the
Alertmanager client (with its bounded HTTP and bearer tokens) that asks whether one still fires."""
