"""Six passages of original prose, invented for the long-context captures (the review
boards and the long village): a fictional incident report, the history of an invented
town, a made-up craft process, a field study of an imaginary bird, a design review of
an invented ferry and the minutes of a made-up town's budget dispute. Nothing here is
quoted from anywhere. Each is between 3,000 and 4,200 characters (about 700 to 1,000
SmolLM2 tokens), of different lengths, so a reader of the captures sees prompts of
several sizes; each comes with the question a board is asked about it.

Standard library only (the apps run in .venv-agents)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Passage:
    title: str
    text: str
    question: str

    def task(self) -> str:
        """The task a board is given: the passage, then the question about it."""
        return f"{self.title}\n\n{self.text}\n\nQuestion: {self.question}"


PUMPING_STATION = Passage(
    "Incident report: the Lower Fen pumping station outage",
    """\
On the night of the fourteenth of March, the Lower Fen pumping station at Harrowmere stopped \
moving water for six hours and forty minutes. The station drains about nine square kilometres \
of reclaimed farmland into the tidal channel, and on that night the channel was running two \
hands higher than the seasonal average after a week of steady rain. By dawn, three farms on the \
western edge of the fen had standing water in their lower fields, and the access road to the \
village of Stell was closed until the following afternoon.

The station has three pumps. Pump one is the oldest, a diesel unit installed when the station \
was built; pumps two and three are electric and were added twelve years ago. In normal \
operation the two electric pumps share the load and the diesel pump is kept as a reserve. A \
float switch in the intake basin starts the second electric pump when the water rises past a \
marked level, and a separate float starts the diesel pump if the water keeps rising.

The sequence of events has been reconstructed from the station's logbook, the supervisory \
system's records and interviews with the two operators on duty. At a quarter past eleven, a \
lightning strike on the overhead line north of the station caused a brief loss of supply. Both \
electric pumps stopped, as they are designed to do. When power returned eleven seconds later, \
pump two restarted on its own, but pump three did not. Its motor protection relay had tripped \
during the disturbance and needed a manual reset. The supervisory system raised an alarm, but \
the alarm was one of forty-two raised within the same minute, most of them harmless \
notifications that power had dipped and returned. The operators acknowledged the alarms as a \
group, which the system allows, and the message about pump three was not read.

With only one electric pump running, the water in the intake basin rose slowly. The diesel \
pump should have started when the second float was lifted. It did not, because the float arm \
had been bent during maintenance work in January and no longer moved freely; it rested against \
the basin wall and stayed down even when the water covered it. The maintenance record shows \
that the float was inspected in February, but the inspection form asks only whether the float \
is present and undamaged, and the inspector ticked both boxes.

At about two in the morning, an operator walking the basin noticed the water level and started \
the diesel pump by hand. It ran well, but the basin had by then overflowed into the relief \
channel, and the relief channel had backed up into the field drains. Pump three was reset at \
twenty to six, after a second operator worked through the alarm history and found the relay \
message. Normal levels returned by mid-morning.

The investigation found no single cause. The lightning strike was outside anyone's control, \
and the relay tripped as it is meant to. What turned a short interruption into a long outage \
was the combination of an alarm that was hard to see among many others, and a backup start \
that had silently stopped working. Either failure alone would probably have been caught: a \
visible alarm would have led to an early reset, and a working float would have started the \
diesel pump within minutes.

The report makes four recommendations. First, alarms should be ranked, so that a pump failing \
to restart appears above routine power notifications, and group acknowledgement should not be \
allowed for alarms of the highest rank. Second, the float inspection form should require the \
inspector to lift each float by hand and confirm that the linked pump responds. Third, the \
relay on pump three should be replaced with a model that resets itself once supply has been \
stable for thirty seconds, as the relay on pump two already does. Fourth, the station should \
run a monthly test in which supply is cut on purpose and the operators confirm that every pump \
returns to service without help.""",
    "What turned a brief power interruption into an outage of more than six hours, and which "
    "recommendation addresses each of those causes?",
)

CALLOWAY_FORD = Passage(
    "A short history of Calloway Ford",
    """\
Calloway Ford began as a place where the river Teme could be crossed on foot in late summer. \
The water there spreads over a wide bed of gravel, and for a few weeks each year it runs no \
deeper than a person's knee. Drovers bringing sheep down from the hill pastures to the markets \
of the plain used the crossing for generations before anyone lived beside it. The first \
building on record is an inn, put up by a family named Calloway to serve the drovers, who \
often had to wait several days for the water to fall.

For most of its early history the settlement was small and seasonal. The inn did its trade in \
late summer and early autumn, and for the rest of the year the few families who stayed kept \
goats and cut willow for baskets. A timber bridge was built about a mile upstream by a \
landowner who charged a toll, and for a time it seemed the ford would be abandoned. The \
drovers, however, refused to pay, and the bridge was washed away in a flood within fifteen \
years of its building and never replaced.

The change that made Calloway Ford a town came from the river gravel itself. A traveller who \
stayed at the inn noticed that the sand in the lower bars was unusually pale and fine, and he \
sent a sample to a glassworks in the city. The glassmakers found it nearly free of iron, which \
meant it could be used to make clear glass without the greenish tint that iron gives. Within \
five years, two small furnaces had been built beside the ford, and the families who had cut \
willow began digging sand instead.

Glassmaking needs fuel as well as sand, and the hills above the town were covered in beech and \
oak. For about forty years the furnaces burned wood, and the slopes were cleared in a pattern \
that can still be seen from the ridge path: long bands of younger woodland running across the \
hillside, each band marking a decade of cutting. When the woods could no longer keep up, the \
town began bringing coal up the river on flat-bottomed barges. The barges could only travel \
when the water was high, so the town's rhythm turned upside down: the busy season was now \
winter and spring, and the old summer crossing became the quiet time of year.

At its height Calloway Ford had nine furnaces, a school, two chapels and a population of \
nearly three thousand. Its glass was known for its clarity, and its makers specialised in \
lenses for lamps and, later, for the lighthouses along the coast. A lens-grinding workshop \
opened in the old inn, which had lost its drovers to the railway, and the workshop's \
apprentices were taught mathematics in the evenings by the schoolmaster.

The decline came slowly. Larger glassworks near the coalfields could make glass more cheaply, \
and the lighthouse trade moved to makers who could supply whole lantern assemblies rather than \
lenses alone. One by one the furnaces closed, the last of them shortly after the town's \
centenary celebrations. The population fell by half within a generation.

Today the town is known mainly to walkers. The gravel bars are protected, and digging is no \
longer allowed. The lens workshop has become a small museum, where visitors can see the \
grinding wheels and a lighthouse lens taller than a person. Each year, in late summer, the \
town holds a festival at which a flock of sheep is driven across the ford, a reminder that \
the place began as a crossing before it was ever a town.""",
    "Explain how the town's busy season changed over its history, and what caused each change.",
)

REED_PAPER = Passage(
    "How the Vetch Valley cooperative makes reed paper",
    """\
The paper made by the Vetch Valley cooperative is pressed from the stems of the common marsh \
reed, which grows in the flooded meadows along the lower valley. The cooperative has about \
thirty members, most of whom farm for the rest of the year, and paper is made only between \
late autumn and early spring, when the reeds have died back and the farms are quiet. What \
follows describes the process as the cooperative runs it now, after several changes made over \
the last decade.

Cutting begins once the reeds have turned from green to a pale straw colour, usually in the \
second half of November. Stems cut earlier hold too much sap, and paper made from them yellows \
within a few years. The reeds are cut by hand with sickles about a hand's width above the \
water, bundled, and left standing in the field for a week to dry further. Members take care to \
leave every third strip of the meadow uncut, because the birds that nest there in spring need \
old stems for cover, and because the uncut strips help the reed beds recover.

The dried bundles are carried to the mill, a stone building beside the weir. There the stems \
are chopped into pieces about the length of a finger and soaked for three days in large vats \
of river water. Soaking softens the outer skin of the stem, which is then removed by rubbing \
the pieces against a ridged board. This is the slowest step in the process, and it is often \
done by older members and children working together in the evenings.

The cleaned pieces are cooked for most of a day in a solution of wood ash and water. The ash \
comes from the cooperative's own stoves, and its strength is judged by an old test: an egg \
placed in the solution should float with a patch the size of a coin showing above the \
surface. Cooking breaks down the material that binds the fibres together. Afterwards the pulp \
is rinsed many times in clean water until the water runs clear and no longer feels slippery \
between the fingers.

The rinsed fibres are beaten to separate them. The cooperative used to do this with wooden \
mallets on a flat stone, but eight years ago the members built a beater driven by the weir's \
waterwheel, in which a heavy roller turns in an oval trough. The beater does in two hours what \
once took four people a full day, and the members agree that the paper is more even. Some \
older members say it has lost a little of its strength, and a few sheets are still beaten by \
hand each season for customers who ask for them.

To form a sheet, the maker dips a wooden frame with a fine mesh screen into a vat of pulp \
suspended in water, lifts it out level, and shakes it gently from side to side and front to \
back so that the fibres lock together. The wet sheet is turned out onto a felt, another felt \
laid on top, and the stack is built up until it holds about fifty sheets. The stack is then \
pressed in a screw press to squeeze out most of the water.

Drying is done on boards in the loft above the mill, where the warmth of the stoves below \
rises through the floor. Each sheet is brushed onto a board and left for two days. The dried \
sheets are sorted by thickness, and any with holes or thin patches are set aside to be pulped \
again. A good season produces about twelve thousand sheets. Most are sold to bookbinders and \
artists, and a small number go to the regional archive, which uses the paper for repairs \
because it contains no acid and does not darken with age.""",
    "Which steps of the process did the cooperative change or keep for quality reasons, and "
    "what does the passage say each choice does to the finished paper?",
)

PLOVER_STUDY = Passage(
    "Field notes: the ash-throated plover on the Mereth islands",
    """\
The ash-throated plover is a small wading bird that breeds on the shingle beaches of the \
Mereth islands and spends the winter on mudflats far to the south. Until recently, almost \
nothing was known about its numbers or its journey. This summary describes five seasons of \
fieldwork by a team of volunteers and two paid researchers, working from a hut on the largest \
island, and what the work has and has not shown.

The first season was spent simply counting. The team walked every beach on the six islands \
once a week from April to August and recorded each nesting pair. The count found three \
hundred and twelve pairs, far more than the forty or fifty that earlier visitors had guessed. \
The birds were not spread evenly. More than half nested on two beaches on the eastern side of \
the chain, where the shingle is coarse and the beach slopes gently. The fine, steep beaches of \
the western islands held almost none, even though they looked suitable.

In the second season the team began fitting birds with small coloured leg rings, each \
combination unique, so that individuals could be recognised through a telescope without being \
caught again. Ringing showed that most adults returned to the same beach each year and often \
to within a few metres of their previous nest. Young birds were much less faithful: about a \
third of the chicks ringed in one year were later seen breeding on a different island from the \
one where they hatched.

The third season brought a setback. A storm in early June washed over the two eastern beaches \
at high tide and destroyed more than two hundred nests in a single night. Most pairs laid again \
within two weeks, but the second clutches hatched late, and many chicks were still too small \
to fly when the first autumn gales arrived. Breeding success that year was less than a quarter \
of the first two seasons' average. The team noted that the birds nesting highest on the beach, \
near the line of dry seaweed, had lost far fewer nests than those nesting near the water.

The fourth and fifth seasons added tracking. Twenty adults were fitted with tiny geolocators, \
devices that record the time of sunrise and sunset and so allow a bird's rough position to be \
worked out later. Of the twenty, eleven were caught again the following spring and their \
devices recovered. The tracks showed a journey of about six thousand kilometres, made in three \
or four long flights with stops of one to three weeks in between. Every tracked bird stopped at \
the same estuary on the way south, a place the team had never heard of before, where the \
mudflats are now threatened by plans for a new port.

The fieldwork has answered some questions and raised others. The population is larger than \
anyone thought, but it depends heavily on two beaches, and those beaches are exposed to summer \
storms that seem to be getting more frequent. The adults' loyalty to their beaches makes them \
easy to study but slow to move if a beach becomes unsafe, while the young birds' habit of \
wandering may be what allows the species to settle new places. The single shared stopover \
estuary is perhaps the greatest worry, because a loss there would affect every bird at once.

The team has proposed three next steps: to test whether small banks of shingle built at the \
top of the eastern beaches encourage birds to nest higher up; to ring more chicks so that the \
movement of young birds between islands can be measured properly; and to share the tracking \
results with the authorities reviewing the port, so that the estuary's importance is known \
before a decision is made.""",
    "What are the main risks to the plover population described in the notes, and which of the "
    "team's proposed next steps responds to each risk?",
)

CABLE_FERRY = Passage(
    "Design review: replacing the Lake Orva cable ferry",
    """\
The cable ferry across Lake Orva links the villages of Saltash End and Brenn, which are four \
kilometres apart by water and almost forty by road. The present ferry was built thirty-one \
years ago and carries eight cars and sixty passengers. It runs every forty minutes from six in \
the morning until ten at night, and on summer weekends the queue on the Saltash side often \
stretches back past the church. The ferry's hull has corroded badly near the waterline, its \
engines are no longer supported by their maker, and the insurer has said it will not renew \
cover after next year. The district council therefore asked for a review of three options for \
a replacement, and this summary sets out the review's findings.

Option A is a like-for-like replacement: a new diesel ferry of the same size, running on the \
existing cables and landing ramps. It is the cheapest option to build and could enter service \
soonest, within about two years. Its running costs would be similar to today's, and it would \
do nothing about the summer queues. The review also notes that the council's own climate plan \
commits it to cutting emissions from its vehicles and vessels by half within fifteen years, \
and a new diesel ferry would be expected to run for at least thirty.

Option B is a larger electric ferry carrying fourteen cars and one hundred passengers, \
charged at each landing while it loads. Because the crossing is short and the ferry waits at \
each end for several minutes, the batteries would never need to be large. The ferry would be \
quiet and would cut the ferry's emissions almost to nothing, provided the electricity comes \
from clean sources. Its costs are higher. The landing ramps would have to be lengthened for \
the bigger vessel, and the electricity supply at Brenn is too weak to charge it: a new line \
would have to be run along the lake shore for about six kilometres. The network operator has \
said it could build the line within three years, but not sooner.

Option C is to keep a small ferry for foot passengers and cyclists and to build a road bridge \
at the narrows, nine kilometres north of the present crossing. A bridge would end the queues \
for good and would carry traffic at all hours. It is by far the most expensive option, and the \
narrows are a nesting area for divers, which are protected; the environmental assessment alone \
would take at least two years. Residents of Saltash End are also divided. Some welcome the \
bridge; others fear that it would bring through traffic to a village whose lanes were never \
meant for it, and that the shops near the ferry landing would lose their trade.

The review scored each option against five criteria set by the council: cost to build, cost \
to run over thirty years, time to enter service, effect on emissions, and effect on the two \
villages. Option A scored best on cost to build and time to service, and worst on emissions. \
Option C scored best on capacity but worst on cost and on its effect on Saltash End. Option B \
scored well on running costs and emissions, and moderately on everything else, and had the \
highest total score.

The review's main difficulty is timing. The old ferry can run for only about two more years, \
and option B cannot be ready for at least three, because of the new power line. The review \
therefore recommends option B, with a bridging plan: the council should lease a second-hand \
diesel ferry for the gap, which the review estimates would be available and insured, and \
should ask the network operator to begin the power line at once, before the ferry itself is \
ordered. The review also recommends that the landing ramps be designed now for the larger \
vessel, so that work on them can begin as soon as the old ferry is withdrawn.

Two members of the review panel disagreed with the recommendation. One argued that a leased \
ferry would be unreliable and that the risk of a gap in service, even for a few weeks, was \
unacceptable for residents who depend on the crossing to reach work and the hospital. The \
other argued that the bridge had been dismissed too quickly, and that its cost should be \
weighed over a much longer life than thirty years.""",
    "Why does the review recommend option B even though it cannot be ready in time, and what "
    "objections to that recommendation does the passage report?",
)

ORRIN_BAY_BUDGET = Passage(
    "Minutes in brief: the Orrin Bay harbour wall dispute",
    """\
These notes summarise three meetings of the Orrin Bay town council, held over the winter, \
about whether to repair the old harbour wall or to replace it. The wall protects the inner \
harbour, where about forty small fishing boats and a dozen pleasure craft are moored, and the \
row of houses and workshops along the quay. It was built of granite blocks more than a century \
ago and has been patched many times since. In the autumn, after a heavy storm, a section near \
the lifeboat slipway settled by several centimetres and a crack opened along its top.

At the first meeting, the council heard from the engineer it had hired to survey the wall. She \
explained that the wall was in better condition than its appearance suggested. The granite \
itself was sound; the problem was the rubble and clay packed behind the facing blocks, which \
had been washed out in places by water forced through the joints. Where the fill was gone, the \
facing blocks had nothing to rest against, and the settled section was one of those places. \
She proposed a repair: to pump grout into the voids behind the wall, to repoint the joints, \
and to rebuild the settled section on a new footing. She estimated the work at a little under \
a third of the cost of a new wall and said it would give the wall another forty years if the \
joints were inspected every five.

Several councillors were not convinced. The chair of the harbour committee pointed out that \
the wall had been "given another forty years" twice before, by earlier surveys that the town \
still had on file. He argued that sea levels and storms would only increase, and that a new \
wall, built higher and with a wider base, would protect the quay for a century. A representative \
of the fishermen's association supported him, adding that a new wall could include a deeper \
berth for the larger boats that currently have to unload at the neighbouring port.

The second meeting was given over to money. The town's treasurer explained that the council \
could pay for the repair from its reserves, without borrowing, but that a new wall would need a \
loan repaid over twenty-five years, which would mean raising the harbour dues and, very likely, \
the local rates. A grant for coastal defence might cover up to half the cost of a new wall, but \
the application would take a year to decide and was not certain. The treasurer also warned \
that the settled section could not wait a year: the engineer had advised that it be made safe \
before the next winter, whatever else was decided.

Residents who spoke at the second meeting were split along lines the council had not expected. \
Owners of houses on the quay, who pay the highest rates, mostly favoured the cheaper repair. \
Younger residents, many of whom work on the boats, favoured the new wall and the deeper berth, \
arguing that the harbour's trade would shrink without it. The owner of the boatyard said he \
would support whichever option brought work to the town rather than to contractors from the \
city, and asked that the tender say so.

At the third meeting, the council agreed a compromise. The settled section will be rebuilt on \
a new footing this summer, paid for from reserves, as the engineer advised. The grouting and \
repointing of the rest of the wall will be postponed for one year. In that year the council \
will apply for the coastal defence grant and commission a design for a new wall, including the \
deeper berth, so that the two choices can be compared on firm figures rather than estimates. \
If the grant is refused, the council will carry out the full repair the following summer. The \
vote was seven to four. The councillors who voted against said that the compromise spent money \
twice, on a section of wall that a new design might not keep, and that postponing the repair \
left the rest of the wall at risk for another winter. The council agreed to ask the engineer \
whether the postponement was safe, and to publish her answer before the tender was issued.""",
    "What did the council finally decide, why did it decide that rather than the full repair or "
    "a new wall, and what did the councillors who voted against object to?",
)

PASSAGES: list[Passage] = [PUMPING_STATION, CALLOWAY_FORD, REED_PAPER, PLOVER_STUDY, CABLE_FERRY,
                           ORRIN_BAY_BUDGET]
