// The sidebar's usage line: this month's requests, tokens and cost (GET /v1/usage), with the
// organisation's budget where it has one and a per-model breakdown in the tooltip.

import { api } from "./api.js";
import { formatCost, plural } from "./view.js";

const usageEl = document.getElementById("usage-summary");

function usageLine(row) {
  const tokens = (row.prompt_tokens || 0) + (row.completion_tokens || 0);
  const cost = formatCost(Number(row.cost_usd || 0));
  return `${plural(row.num_requests ?? row.requests ?? 0, "request")} \u00b7 ${plural(tokens, "token")} \u00b7 ${cost}`;
}

// "of $5.00 budget" when the organisation has a monthly budget; near or past it, highlighted.
function budgetNote(budget) {
  if (!budget || budget.budget_usd == null) return "";
  const limit = Number(budget.budget_usd);
  const spent = Number(budget.month_spend_usd || 0);
  usageEl.classList.toggle("usage-near-limit", spent >= 0.8 * limit);
  // Under a cent, cents would say "$0.00": as precise as the spending beside it instead.
  return ` of ${limit >= 0.01 ? `$${limit.toFixed(2)}` : formatCost(limit)} budget`;
}

export async function refreshUsage() {
  try {
    const { data, total, budget } = await api.usage();
    usageEl.classList.remove("usage-near-limit");
    usageEl.textContent = `This month: ${usageLine(total)}${budgetNote(budget)}`;
    usageEl.title = data.map((row) => `${row.model}: ${usageLine(row)}`).join("\n");
  } catch {
    usageEl.textContent = "This month: usage unavailable";
  }
}
