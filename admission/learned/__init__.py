"""What admission learns from what it sees: the engines' service and drain, the clients'
patience, retries and told waits, and how many tokens requests use (sans-IO; these modules
import only each other and admission.config)."""
