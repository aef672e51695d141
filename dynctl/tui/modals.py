"""Dialogs: ask a threshold (validated), confirm a destructive action (Cancel is the default)."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.validation import ValidationResult, Validator
from textual.widgets import Button, Input, Label, Static

from dynctl.base import hostspec


class ThresholdRule(Validator):
    """The threshold rule every other entry point applies (hostspec.threshold_problem), as an Input validator."""

    def validate(self, value: str) -> ValidationResult:
        problem = hostspec.threshold_problem(value)
        return self.failure(f"a whole number from {hostspec.MIN_THRESHOLD} to {hostspec.MAX_THRESHOLD:,} ({problem})",
                            value) if problem else self.success()


class ThresholdModal(ModalScreen[int | None]):
    """Asks for a batch-size threshold; dismisses with the number, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, prompt: str, confirm_label: str, initial: int | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.prompt = prompt
        self.confirm_label = confirm_label
        self.initial = initial

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.title_text, id="dialog-title")
            yield Static(self.prompt, id="dialog-prompt")
            yield Input(
                value="" if self.initial is None else str(self.initial),
                placeholder=f"{hostspec.MIN_THRESHOLD}–{hostspec.MAX_THRESHOLD:,}",
                type="integer",
                validators=[ThresholdRule()],
                validate_on=["changed", "submitted"],
                id="threshold-input",
            )
            yield Static("", id="dialog-error")
            with Horizontal(id="dialog-buttons"):
                yield Button("Cancel", id="cancel")
                yield Button(self.confirm_label, id="confirm", variant="warning")

    def on_mount(self) -> None:
        self.query_one(Input).focus()

    def _error(self, text: str) -> None:
        self.query_one("#dialog-error", Static).update(text)

    @on(Input.Changed)
    def _changed(self, event: Input.Changed) -> None:
        result = event.validation_result
        self._error("" if result is None or result.is_valid or not event.value
                    else "threshold must be " + "; ".join(result.failure_descriptions))

    def _submit(self) -> None:
        field = self.query_one(Input)
        result = field.validate(field.value)
        if not field.value.strip():
            self._error("enter a threshold: the batch size above which speculation is skipped")
            return
        if result is not None and not result.is_valid:
            self._error("threshold must be " + "; ".join(result.failure_descriptions))
            return
        self.dismiss(int(field.value))

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self._submit()

    @on(Button.Pressed, "#confirm")
    def _confirmed(self) -> None:
        self._submit()

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmModal(ModalScreen[bool]):
    """Yes/no before something that stops or changes a server; Cancel has the focus."""

    BINDINGS = [Binding("escape,n", "cancel", "Cancel"), Binding("y", "confirm", "Yes")]

    def __init__(self, question: str, detail: str = "", confirm_label: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.detail = detail
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="dialog-title")
            if self.detail:
                yield Static(self.detail, id="dialog-prompt")
            with Horizontal(id="dialog-buttons"):
                yield Button("Cancel (n)", id="cancel")
                yield Button(f"{self.confirm_label} (y)", id="confirm", variant="error")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed, "#confirm")
    def action_confirm(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(False)
